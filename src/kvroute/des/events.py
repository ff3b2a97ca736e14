"""The event heap of the discrete-event simulator: virtual time, no sleeping, no threads.

An event is (time, priority, sequence number, handler, argument). Events at one instant
run in priority order, then in the order they were pushed, so a run is a function of its
inputs alone. The priorities say what happens first when things coincide: a request
reaches its engine (ARRIVE) before the engine starts a step at that instant (STEP), as
in the HTTP simulator, where a request that arrives while the engine loop wakes is in
the next batch; everything the router and the clients do (OBSERVE) sits between.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

ARRIVE = 0  # a request enters an engine
OBSERVE = 1  # router and client events: sends, tokens seen, scrapes, KV event deliveries
STEP = 2  # an engine starts its next step (and hands out the last one's tokens)

Handler = Callable[[float, Any], None]


class EventQueue:
    """A min-heap of timed calls; ``run`` pops and calls them until none is left."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Handler, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0  # time of the event being run (virtual seconds)
        self.num_events = 0  # events run so far

    def push(self, at: float, priority: int, handler: Handler, arg: Any = None) -> None:
        """Run ``handler(at, arg)`` at time ``at`` (never before the present)."""
        if at < self.now:
            raise ValueError(f"event at {at} is in the past (now {self.now})")
        heapq.heappush(self._heap, (at, priority, next(self._seq), handler, arg))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            at, _, _, handler, arg = pop(heap)
            self.now = at
            self.num_events += 1
            handler(at, arg)
