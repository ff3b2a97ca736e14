"""Round-robin: the baseline every router ships."""

from __future__ import annotations

from kvroute.core.policy.base import Decision, FleetView, NoParams, Policy, Reason, RouteRequest

RANKED_LIMIT = 8  # backends listed in Decision.ranked for retries


class RoundRobinPolicy(Policy):
    """Each request goes to the next eligible backend in URL order.

    What it does: cycles a cursor over the eligible backends, sorted by URL.
    When it loses: it ignores caches and load; with N backends a repeated prefix lands on
    its holder about 1/N of the time, and a slow backend gets as much work as a fast one.
    Inputs: only the eligible list. Knobs: none.
    """

    name = "round_robin"

    def __init__(self, params: NoParams | None = None) -> None:
        self._cursor = 0  # requests routed so far

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        candidates = view.candidates()
        if not candidates:
            return None
        n = len(candidates)
        start = self._cursor % n
        self._cursor += 1
        ranked = tuple(candidates[(start + i) % n] for i in range(min(n, RANKED_LIMIT)))
        return Decision(ranked[0], Reason.ROUND_ROBIN, 0, ranked)
