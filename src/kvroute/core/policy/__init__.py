"""Routing policies: one registry and one factory (``make_policy``)."""

from __future__ import annotations

from typing import Any

from kvroute.core.policy.base import Decision, FleetView, LoadView, Policy, RouteRequest
from kvroute.core.policy.consistent_hash import ConsistentHashPolicy
from kvroute.core.policy.least_load import LeastLoadPolicy
from kvroute.core.policy.power_of_two import PowerOfTwoPolicy
from kvroute.core.policy.prefix import PrefixPolicy
from kvroute.core.policy.random_policy import RandomPolicy
from kvroute.core.policy.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadPolicy,
        PowerOfTwoPolicy,
        ConsistentHashPolicy,
        PrefixPolicy,
    )
}


def policy_names() -> list[str]:
    """Known policy names, sorted."""
    return sorted(POLICIES)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy called ``name``; ValueError lists the known names."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    return cls(**kwargs)


__all__ = [
    "POLICIES",
    "ConsistentHashPolicy",
    "Decision",
    "FleetView",
    "LeastLoadPolicy",
    "LoadView",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
    "policy_names",
]
