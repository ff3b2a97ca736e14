"""How a workload is offered: closed loop, open loop or trace schedule (pure config)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvroute.bench.arrivals import arrival_offsets
from kvroute.bench.spec import Session
from kvroute.bench.workloads.base import Workload

MODES = ("closed", "open", "trace")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One run's load; ``__post_init__`` raises ValueError naming a bad field.

    closed: ``num_users`` users each send, wait for the end of the response, think
    U(think_time_s), repeat (multi-turn sessions think their own time between turns).
    open: sessions start at Gamma arrivals of ``rates`` (a ladder when several), as
    ``vllm bench serve``; ``max_concurrency`` queues requests client-side.
    trace: each request is sent at its spec's ``arrival_s``.
    The run ends at ``num_requests`` measured requests or ``duration_s``, whichever
    comes first, or when the workload ends; in-flight requests are awaited.
    """

    mode: str  # "closed", "open" or "trace"
    num_users: int = 30  # closed: concurrent users
    think_time_s: tuple[float, float] = (0.0, 0.0)  # closed: uniform pause after a session
    rates: tuple[float, ...] = (math.inf,)  # open: requests/s (sessions/s); inf = all at once
    burstiness: float = 1.0  # open: Gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None  # open/trace: cap on requests in flight
    num_requests: int | None = None  # measured requests to send (warm-up not counted)
    duration_s: float | None = None  # stop sending after this long
    num_warmup: int = 0  # requests sent first and left out of the metrics
    seed: int = 0  # think times and arrivals
    model: str | None = None  # "model" field; None: first of the target's /v1/models
    ignore_eos: bool = False  # send vLLM's ignore_eos so outputs reach max_tokens
    # False: non-streaming requests (the openai SDK's default); TTFT is then the whole
    # response time, as vLLM's bench reports it for non-streaming backends
    stream: bool = True
    request_timeout_s: float = 600.0  # per request, whole response

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"LoadConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.num_users < 1:
            raise ValueError("LoadConfig.num_users must be >= 1")
        lo, hi = self.think_time_s
        if not 0 <= lo <= hi < math.inf:
            raise ValueError("LoadConfig.think_time_s must be 0 <= a <= b, finite")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError("LoadConfig.rates must be values > 0")
        if not self.burstiness > 0:
            raise ValueError("LoadConfig.burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("LoadConfig.max_concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 0:
            raise ValueError("LoadConfig.num_requests must be >= 0")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise ValueError("LoadConfig.duration_s must be > 0 and finite")
        if self.num_warmup < 0:
            raise ValueError("LoadConfig.num_warmup must be >= 0")
        if not 0 < self.request_timeout_s < math.inf:
            raise ValueError("LoadConfig.request_timeout_s must be > 0 and finite")
        unbounded = self.num_requests is None and self.duration_s is None
        if self.mode == "open" and len(self.rates) > 1 and unbounded:
            raise ValueError("a rate ladder needs num_requests or duration_s")

    def to_json(self) -> dict[str, Any]:
        """JSON-safe view for result.json (an infinite rate is written "inf")."""
        out = dataclasses.asdict(self)
        out["rates"] = [r if math.isfinite(r) else "inf" for r in self.rates]
        return out


def default_load(workload: Workload, **overrides: Any) -> LoadConfig:
    """The load the workload's source runs it at, with ``overrides`` applied.

    The workload's users, think time, rates and concurrency cap apply only when the mode
    stays the workload's own. Without a bound in ``overrides``, the run length is the
    workload's default count.
    """
    d = workload.defaults
    fields: dict[str, Any] = {"mode": d.mode, "seed": workload.seed}
    if overrides.get("mode", d.mode) == d.mode:  # the source's shape only for its own mode
        fields.update(
            num_users=d.num_users,
            think_time_s=d.think_time_s,
            rates=d.rates,
            max_concurrency=d.max_concurrency,
        )
    fields.update(overrides)
    if fields.get("num_requests") is None and fields.get("duration_s") is None:
        fields["num_requests"] = d.num_requests
    return LoadConfig(**fields)


WARMUP_MAX_CONCURRENCY = 16  # warm-up requests in flight at most


def warmup_sessions(load: LoadConfig, sessions: Iterator[Session]) -> list[Session]:
    """The whole sessions the warm-up sends: drawn until they hold ``num_warmup`` requests."""
    chosen: list[Session] = []
    while sum(len(s) for s in chosen) < load.num_warmup:
        session = next(sessions, None)
        if session is None:
            break
        chosen.append(session)
    return chosen


def warmup_concurrency(load: LoadConfig) -> int:
    """Warm-up requests in flight at most (never more than the run itself allows)."""
    return min(WARMUP_MAX_CONCURRENCY, load.num_users, load.max_concurrency or 16)


def timed_sessions(
    load: LoadConfig, sessions: Iterator[Session], rng: random.Random
) -> Iterator[tuple[float, Session]]:
    """(send offset from the run start, session) of an open or trace run: Gamma arrivals
    drawn from ``rng`` (open), the first turn's ``arrival_s`` (trace). After a warm-up
    (which took the trace's first rows) the measured rows start at the first of them,
    not at their place in the trace (an idle gap the length of the warm-up's rows)."""
    if load.mode == "trace":
        shift: float | None = None if load.num_warmup else 0.0
        for session in sessions:
            at = session[0].arrival_s or 0.0
            if shift is None:
                shift = at
            yield at - shift, session
        return
    offsets = arrival_offsets(
        rng, load.rates, load.burstiness, num_requests=load.num_requests,
        duration_s=load.duration_s,
    )  # fmt: skip
    yield from zip(offsets, sessions, strict=False)
