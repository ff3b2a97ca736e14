"""Uniform random choice: the baseline with no state."""

from __future__ import annotations

from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Reason,
    RouteRequest,
    SeededPolicy,
    rest_by_load,
)


class RandomPolicy(SeededPolicy):
    """Each request goes to a uniformly random eligible backend.

    What it does: ``rng.choice`` over the eligible backends (sorted by URL, so a seeded
    generator reproduces the same sequence). When it loses: like round-robin it ignores
    caches and load, and short runs are lumpy. Inputs: the eligible list, a seeded
    ``random.Random`` (its own if given, else the fleet's). Knobs: ``rng``.
    """

    name = "random"

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        candidates = view.candidates()
        if not candidates:
            return None
        rng = self.rng_for(view)
        url = candidates[rng.randrange(len(candidates))]
        return Decision(url, Reason.RANDOM, 0, rest_by_load(view, [url]))
