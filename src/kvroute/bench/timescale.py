"""Offer a workload faster, in step with engines that run ``--speedup`` times real time.

When the simulated engines divide every modelled duration by ``X``, the client must
divide its own pauses (think times, arrival gaps) by ``X`` too, or the load changes
shape: users would think ten times longer relative to the engines' work. Both wrappers
here are pure; the measured latencies stay wall-clock seconds (engine time = X x wall).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from kvroute.bench.load import LoadConfig
from kvroute.bench.spec import RequestSpec, Session
from kvroute.bench.workloads.base import Workload


def _scaled_spec(spec: RequestSpec, speedup: float) -> RequestSpec:
    arrival = None if spec.arrival_s is None else spec.arrival_s / speedup
    return dataclasses.replace(spec, arrival_s=arrival, think_time_s=spec.think_time_s / speedup)


class TimeScaled(Workload):
    """``inner``'s sessions with their think times and arrival offsets divided by ``speedup``."""

    def __init__(self, inner: Workload, speedup: float) -> None:
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"speedup must be a finite number > 0, got {speedup!r}")
        super().__init__(inner.params, inner.seed)
        self.inner = inner
        self.speedup = speedup
        self.name = inner.name  # type: ignore[misc] (instance label; the class has none)
        self.defaults = inner.defaults  # type: ignore[misc]

    def sessions(self) -> Iterator[Session]:
        if self.speedup == 1.0:
            yield from self.inner.sessions()
            return
        for session in self.inner.sessions():
            yield tuple(_scaled_spec(spec, self.speedup) for spec in session)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "time_scale": 1.0 / self.speedup}


def scale_load(load: LoadConfig, speedup: float) -> LoadConfig:
    """``load`` with think times divided and open-loop rates multiplied by ``speedup``.

    ``duration_s`` is left alone: it is the wall-clock length of the measured run.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup!r}")
    lo, hi = load.think_time_s
    return dataclasses.replace(
        load,
        think_time_s=(lo / speedup, hi / speedup),
        rates=tuple(r * speedup for r in load.rates),
    )
