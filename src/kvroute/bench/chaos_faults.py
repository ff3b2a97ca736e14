"""The chaos run's faults: a seeded schedule of them, and which failures they explain.

Faults (``make_schedule``, pure: same seed, same schedule) are ``kill`` (SIGKILL, started
again when the fault ends) and the simulator's own (sim/faults.py): ``hang``, ``slow``,
``error``, ``drop``, ``unhealthy``, ``flap``, ``kv_gap``, ``kv_garbage``. At most N-1
backends are faulted at once and each backend has one fault at a time.

After a run, each request's outcome (``outcome_of``) and each failure's fault
(``attribute``: the faults whose window it overlaps, on the backend that failed it when
known) make the report's counts (bench/chaos.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.bench import hardening as h

FAULT_KINDS = ("kill", "hang", "slow", "error", "drop", "unhealthy", "flap", "kv_gap",
               "kv_garbage")  # fmt: skip


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One fault on one backend over [start_s, end_s) (seconds since the load started)."""

    start_s: float
    end_s: float
    backend: int
    kind: str  # FAULT_KINDS
    change: dict[str, Any]  # the /sim/faults body ({} for kill)


def make_schedule(
    seed: int,
    num_backends: int,
    duration_s: float,
    *,
    kinds: Sequence[str] = FAULT_KINDS,
    mean_gap_s: float = 2.0,
    fault_s: tuple[float, float] = (2.0, 6.0),
    quiet_tail_s: float = 2.0,
) -> list[FaultEvent]:
    """A seeded list of faults, by start time (module doc for the rules)."""
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be among {list(FAULT_KINDS)}, got {list(kinds)}")
    rng = random.Random(seed)
    end_by = duration_s - quiet_tail_s
    busy_until = [0.0] * num_backends
    events: list[FaultEvent] = []
    t = 1.0
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= end_by:
            return events
        free = [b for b in range(num_backends) if busy_until[b] <= t]
        if len(free) <= 1:  # at least one backend stays fault-free
            continue
        backend = rng.choice(free)
        kind = rng.choice(list(kinds))
        end = min(t + rng.uniform(*fault_s), end_by)
        events.append(FaultEvent(round(t, 3), round(end, 3), backend, kind, _change(kind, rng)))
        busy_until[backend] = end


def _change(kind: str, rng: random.Random) -> dict[str, Any]:
    values: dict[str, Callable[[], Any]] = {
        "kill": lambda: None,
        "hang": lambda: True,
        "unhealthy": lambda: True,
        "slow": lambda: rng.choice([3.0, 10.0]),
        "error": lambda: rng.choice([500, 503]),
        "drop": lambda: rng.randint(1, 4),
        "flap": lambda: rng.choice([0.3, 0.7]),
        "kv_gap": lambda: rng.randint(2, 5),
        "kv_garbage": lambda: rng.randint(1, 3),
    }
    value = values[kind]()
    return {} if kind == "kill" else {kind: value}


def outcome_of(shot: h.Shot) -> str:
    """ok | expected_4xx | disconnected, or the failure (http_502, stream_cut, ...)."""
    if shot.failure is None:
        if shot.kind in h.MALFORMED:
            return "expected_4xx"
        return "disconnected" if shot.kind == "disconnect" else "ok"
    return shot.failure


def attribute(
    shots: Sequence[h.Shot], schedule: Sequence[FaultEvent], grace_s: float,
    urls: Sequence[str] = (),
) -> tuple[dict[str, int], dict[str, list[h.Shot]]]:  # fmt: skip
    """Failures per fault kind whose window (+ grace) they overlap, on the backend that
    failed them when known (its x-kvroute-backend, or a URL of ``urls`` in the error), else
    on any; kind "none": failures overlapping no fault (a fault-free fleet fails none)."""
    by_kind: dict[str, list[h.Shot]] = {}
    for s in shots:
        if s.failure is None:
            continue
        where = _backend_index(s, urls)
        kinds = {
            e.kind for e in schedule
            if s.t0_s <= e.end_s + grace_s and s.t1_s >= e.start_s
            and where in (None, e.backend)
        }  # fmt: skip
        for k in kinds or {"none"}:
            by_kind.setdefault(k, []).append(s)
    counts = {k: len(v) for k, v in sorted(by_kind.items(), key=lambda kv: -len(kv[1]))}
    return counts, by_kind


def _backend_index(shot: h.Shot, urls: Sequence[str]) -> int | None:
    for i, url in enumerate(urls):
        if shot.backend == url or url + "/" in shot.detail:
            return i
    return None
