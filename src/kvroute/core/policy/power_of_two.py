"""Power of two choices: sample two backends, keep the less loaded."""

from __future__ import annotations

from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Reason,
    RouteRequest,
    SeededPolicy,
    rendezvous_score,
    request_key,
    rest_by_load,
)


class PowerOfTwoPolicy(SeededPolicy):
    """Each request goes to the less loaded of two random eligible backends.

    What it does: samples two distinct candidates with a seeded generator and keeps the
    one with fewer in-flight tokens per weight (ties: rendezvous hash of the request's
    first block). Its load numbers are counted at dispatch, not polled, so it does not
    herd on stale data. When it loses: it ignores caches; with few backends it is close
    to least-load, with many it avoids the worst without finding the best. Inputs: load,
    rng. Knobs: ``rng`` (its own, else the fleet's).
    """

    name = "power_of_two"

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        candidates = view.candidates()
        if not candidates:
            return None
        rng = self.rng_for(view)
        picks = [candidates[i] for i in rng.sample(range(len(candidates)), min(2, len(candidates)))]
        key = request_key(request)

        def rank(url: str) -> tuple[float, int]:
            load = view.load(url)
            return (load.in_flight_tokens / load.weight, -rendezvous_score(key, url))

        picks.sort(key=rank)
        return Decision(picks[0], Reason.LOAD, 0, rest_by_load(view, picks))
