"""Least load: the backend with the fewest in-flight tokens per unit of weight."""

from __future__ import annotations

from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    RouteRequest,
    rendezvous_order,
    request_key,
)


class LeastLoadPolicy(Policy):
    """Each request goes to the backend with the least in-flight work.

    What it does: takes the least-loaded eligible backends from the fleet's load order
    (in-flight tokens = queued prefill + decode to come, per unit of weight, merged with
    the engines' gauges); among those tied with the minimum (at most ``max_ties``), the
    rendezvous hash of the request's first block decides, so independent routers agree
    and equal prompts tend to meet. When it loses: it ignores caches, so a shared prefix
    is recomputed wherever the load sends it. Inputs: load. Knobs: ``max_ties`` (64),
    ``ranked_limit`` (8).
    """

    name = "least_load"

    def __init__(self, *, max_ties: int = 64, ranked_limit: int = 8) -> None:
        if max_ties < 1 or ranked_limit < 1:
            raise ValueError("least_load: max_ties and ranked_limit must be >= 1")
        self.max_ties = max_ties
        self.ranked_limit = ranked_limit

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
        return Decision(ranked[0], "load", 0, tuple(ranked))
