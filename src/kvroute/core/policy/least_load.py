"""Least load: the backend with the fewest in-flight tokens per unit of weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    rendezvous_order,
    request_key,
)


@dataclass(frozen=True, slots=True)
class LeastLoadParams:
    """The least-load policy's knobs (YAML ``policies.least_load``)."""

    SECTION: ClassVar[str] = "least_load"

    max_ties: int = param(64, ge=1)  # tied backends the rendezvous hash chooses among
    ranked_limit: int = param(8, ge=1)  # backends in Decision.ranked (retries walk it)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class LeastLoadPolicy(Policy):
    """Each request goes to the backend with the least in-flight work.

    What it does: takes the least-loaded eligible backends from the fleet's load order
    (in-flight tokens = queued prefill + decode to come, per unit of weight, merged with
    the engines' gauges); among those tied with the minimum (at most ``max_ties``), the
    rendezvous hash of the request's first block decides, so independent routers agree
    and equal prompts tend to meet. When it loses: it ignores caches, so a shared prefix
    is recomputed wherever the load sends it. Inputs: load. Knobs (``LeastLoadParams``):
    ``max_ties`` (64), ``ranked_limit`` (8).
    """

    name = "least_load"
    Params = LeastLoadParams

    def __init__(self, params: LeastLoadParams | None = None) -> None:
        params = params or LeastLoadParams()
        self.max_ties = params.max_ties
        self.ranked_limit = params.ranked_limit

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = view.least_loaded(max(self.max_ties, self.ranked_limit))
        if not urls:
            return None

        def per_weight(url: str) -> float:
            load = view.load(url)
            return load.in_flight_tokens / load.weight

        lowest = per_weight(urls[0])
        ties = [u for u in urls if per_weight(u) == lowest]
        rest = [u for u in urls if per_weight(u) != lowest]
        ranked = (rendezvous_order(request_key(request), ties) + rest)[: self.ranked_limit]
        return Decision(ranked[0], Reason.LOAD, 0, tuple(ranked))
