"""Routing policies: one registry and one factory (``make_policy``).

Each policy class declares its knobs as ``Params`` (a frozen dataclass: types, defaults,
ranges) and parses them itself (``Policy.parse_params``); the registry maps names to
classes, and ``make_policy`` builds one from a name and its parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvroute.core.params import ConfigError, field_names
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    LoadView,
    NoParams,
    Policy,
    Reason,
    RouteRequest,
)
from kvroute.core.policy.chwbl import ChwblPolicy
from kvroute.core.policy.consistent_hash import ConsistentHashParams, ConsistentHashPolicy
from kvroute.core.policy.dualmap import DualMapPolicy
from kvroute.core.policy.dynamo import DynamoPolicy
from kvroute.core.policy.least_load import LeastLoadParams, LeastLoadPolicy
from kvroute.core.policy.llmd import LlmdNoHitLruPolicy, LlmdPolicy
from kvroute.core.policy.power_of_two import PowerOfTwoPolicy
from kvroute.core.policy.prefix import PrefixParams, PrefixPolicy
from kvroute.core.policy.random_policy import RandomPolicy
from kvroute.core.policy.round_robin import RoundRobinPolicy
from kvroute.core.policy.sglang_cache_aware import SglangCacheAwarePolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadPolicy,
        PowerOfTwoPolicy,
        ConsistentHashPolicy,
        PrefixPolicy,
        SglangCacheAwarePolicy,  # a model of a peer, for the simulator (issue 14)
        DynamoPolicy,  # a model of a peer (issue 14)
        DualMapPolicy,  # a model of a peer (issue 14)
        LlmdPolicy,  # a model of a peer (issue 14)
        LlmdNoHitLruPolicy,  # a model of a peer (issue 14)
        ChwblPolicy,  # a model of a peer (issue 14)
    )
}


def policy_names() -> list[str]:
    """Known policy names, sorted."""
    return sorted(POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The policy class called ``name``; ConfigError ``policy`` lists the known names."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError("policy", f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    return cls


def default_params() -> dict[str, Any]:
    """Every policy's parameters at their defaults, by policy name."""
    return {name: cls.Params() for name, cls in sorted(POLICIES.items())}


def make_policy(name: str, params: object = None, **kwargs: Any) -> Policy:
    """Build the policy called ``name`` (ValueError lists the known names).

    ``params``: its ``Params``, or a mapping its factory parses (None: defaults).
    Keyword arguments that name a parameter are parameters too
    (``make_policy("prefix", max_holders=8)``); the rest go to the constructor
    (``rng=Random(1)``).
    """
    cls = policy_class(name)
    names = set(field_names(cls.Params))
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if params is None or isinstance(params, Mapping) or extra:
        raw = params if isinstance(params, Mapping) else {}
        if params is not None and not isinstance(params, Mapping):
            raw = {n: getattr(params, n) for n in names}
        params = cls.parse_params({**raw, **extra}, f"policies.{name}")
    factory: Callable[..., Policy] = cls
    return factory(params, **kwargs)


__all__ = [
    "POLICIES",
    "ConsistentHashParams",
    "ConsistentHashPolicy",
    "Decision",
    "FleetView",
    "LeastLoadParams",
    "LeastLoadPolicy",
    "LoadView",
    "NoParams",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixParams",
    "PrefixPolicy",
    "RandomPolicy",
    "Reason",
    "RoundRobinPolicy",
    "RouteRequest",
    "default_params",
    "make_policy",
    "policy_class",
    "policy_names",
]
