"""Soak: a real router under a fixed mixed load for a long time, sampled, with a verdict.

``kvroute serve`` runs in front of N simulators (one process each, KV events on). A
seeded closed-loop load (bench/hardening.py ``MixedLoad``: streaming and not, chat and
completions, a few percent malformed, clients cutting streams) runs for ``duration_s``;
every ``restart_every_s`` one backend (in turn) is SIGKILLed and started again
``restart_down_s`` later. Every ``sample_s`` the router's RSS and open file descriptors
(/proc), its index size, tasks and in-flight load (/metrics) are recorded.

Verdict (all must hold):

- **flat**: for each of RSS, file descriptors, index blocks and tasks (when exported),
  with *steady* = the samples taken at or after ``warmup_s`` and w = max(3, 10 % of
  them): *level* = median of the first w steady samples, *end* = median of the last w;
  flat when end <= level x (1 + tolerance) + slack, slack an absolute floor per series
  (``SLACK``) so that 2 descriptors more than 20 is not a leak. A fall is not a leak.
- **no leaked tickets**: once the load stopped (every request answered or cut), the
  router's in-flight requests and tokens over all backends reach 0 within ``settle_s``.
- **nothing lost**: every request's outcome is ``ok``, ``expected_4xx`` (a malformed
  request refused with an OpenAI error), ``disconnected`` (the client cut it on
  purpose) or ``cut_by_restart`` (it failed while a backend it may have used was being
  killed: the kill instant lies within the request; or it was sent within
  ``STALE_AFTER_KILL_S`` of a kill and got a 502 saying the backend's connection closed
  or reset before any answer: a pooled connection to the dead process, which the router
  must not re-send on, issue 9 finding 2); anything else is ``failed``.
- the router process is still alive at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench import hardening as h
from kvroute.bench import harness_procs as hp

SERIES = ("rss_mib", "fds", "index_blocks", "tasks", "in_flight_requests", "in_flight_tokens")
FLAT_SERIES = ("rss_mib", "fds", "index_blocks", "tasks")
SLACK = {"rss_mib": 4.0, "fds": 4.0, "index_blocks": 64.0, "tasks": 8.0}
STALE_AFTER_KILL_S = 1.0
_DEAD_CONNECTION = re.compile(r"closed the connection|connection failed|reset by peer")
# router-wide gauges read when the router exports them (None in the samples otherwise)
TASKS_GAUGE = "kvroute_event_loop_tasks"
ROUTER_IN_FLIGHT_GAUGE = "kvroute_in_flight_requests"


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """One soak run (defaults: the 30-minute run of BENCHMARKS.md)."""

    duration_s: float = 1800.0  # load time
    sample_s: float = 10.0  # sampling period
    restart_every_s: float = 180.0  # one backend killed and restarted this often (0: never)
    restart_down_s: float = 2.0  # how long it stays down
    warmup_s: float | None = None  # None: max(2 samples, 10 % of the duration)
    backends: int = 3
    users: int = 8  # closed-loop clients
    mode: str = "exact"  # router --mode: exact | approximate | auto
    profile: str = "tiny"  # engine profile of the simulators
    seed: int = 0
    tolerance: float = 0.10  # flat: end within +10 % of the post-warm-up level
    settle_s: float = 15.0  # after the load: time for in-flight load to reach 0
    max_body_bytes: int = 262_144  # router's body limit (the too-large requests exceed it)
    out: Path | None = None  # output folder (None: a new temporary one)

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.sample_s > 0:
            raise ValueError("duration_s and sample_s must be > 0")
        if self.restart_every_s < 0 or self.restart_down_s < 0:
            raise ValueError("restart_every_s and restart_down_s must be >= 0")
        if self.backends < 2:
            raise ValueError("backends must be >= 2 (one is restarted while others serve)")
        if self.users < 1:
            raise ValueError("users must be >= 1")
        if self.mode not in ("exact", "approximate", "auto"):
            raise ValueError(f"mode must be exact, approximate or auto, got {self.mode!r}")

    @property
    def resolved_warmup_s(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return max(2 * self.sample_s, 0.1 * self.duration_s)


@dataclass(frozen=True, slots=True)
class Sample:
    """The router at one instant (t_s: seconds since the load started)."""

    t_s: float
    rss_mib: float
    fds: int
    index_blocks: float | None
    tasks: float | None  # asyncio tasks, when the router exports them
    in_flight_requests: float  # tickets held over all backends
    in_flight_tokens: float
    router_in_flight: float | None  # requests being handled, when exported
    num_done: int  # requests finished so far (client side)
    num_failed: int  # of which failed (any failure, restarts included)


@dataclass(frozen=True, slots=True)
class Restart:
    backend: int
    kill_s: float  # SIGKILL instant, seconds since the load started
    ready_s: float | None  # back up (its /health answered)


@dataclass
class SoakResult:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    final: Sample | None = None  # after the load stopped and the router settled
    restarts: list[Restart] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # "failed" shots by failure
    failed_examples: list[dict[str, Any]] = field(default_factory=list)
    flat: dict[str, dict[str, Any]] = field(default_factory=dict)
    leaked: dict[str, float] = field(default_factory=dict)  # in-flight left after settling
    router_alive: bool = True
    wall_s: float = 0.0
    out: Path | None = None

    @property
    def passed(self) -> bool:
        return (
            all(v["flat"] for v in self.flat.values())
            and not any(self.leaked.values())
            and self.outcomes.get("failed", 0) == 0
            and self.router_alive
        )

    def to_json(self) -> dict[str, Any]:
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()}
        return {
            "config": cfg | {"warmup_s": self.config.resolved_warmup_s},
            "passed": self.passed,
            "flat": self.flat,
            "leaked": self.leaked,
            "outcomes": self.outcomes,
            "failures": self.failures,
            "failed_examples": self.failed_examples,
            "router_alive": self.router_alive,
            "restarts": [asdict(r) for r in self.restarts],
            "samples": [asdict(s) for s in self.samples],
            "final": asdict(self.final) if self.final else None,
            "wall_s": self.wall_s,
        }


# ---- verdict (pure) ----------------------------------------------------------------


def flatness(
    samples: Sequence[Sample], warmup_s: float, tolerance: float
) -> dict[str, dict[str, Any]]:
    """Per FLAT_SERIES present in the samples: level, end, change and flat (module doc)."""
    steady = [s for s in samples if s.t_s >= warmup_s]
    out: dict[str, dict[str, Any]] = {}
    for name in FLAT_SERIES:
        values = [getattr(s, name) for s in steady]
        if not values or any(v is None for v in values):
            if name != "tasks":  # tasks only when exported
                out[name] = {"flat": False, "why": "not enough samples after warm-up"}
            continue
        w = max(3, len(values) // 10)
        if len(values) < w:
            out[name] = {"flat": False, "why": f"{len(values)} samples after warm-up, need {w}"}
            continue
        level = statistics.median(values[:w])
        end = statistics.median(values[-w:])
        limit = level * (1 + tolerance) + SLACK[name]
        change = (end - level) / level if level else None
        out[name] = {"level": level, "end": end, "limit": limit, "change": change,
                     "flat": end <= limit}  # fmt: skip
    return out


def classify(shot: h.Shot, kill_times: Sequence[float]) -> str:
    """ok | expected_4xx | disconnected | cut_by_restart | failed (module doc)."""
    if shot.failure is None:
        if shot.kind in h.MALFORMED:
            return "expected_4xx"
        return "disconnected" if shot.kind == "disconnect" else "ok"
    if any(shot.t0_s <= k <= shot.t1_s for k in kill_times):
        return "cut_by_restart"
    stale = shot.failure == "http_502" and _DEAD_CONNECTION.search(shot.detail)
    if stale and any(0 <= shot.t0_s - k <= STALE_AFTER_KILL_S for k in kill_times):
        return "cut_by_restart"
    return "failed"


# ---- the run -----------------------------------------------------------------------

Notify = Callable[[Sample, "SoakResult"], None]


async def run_soak(config: SoakConfig, notify: Notify | None = None) -> SoakResult:
    """Start everything, run the load with restarts and sampling, settle, judge."""
    out = config.out or Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    result = SoakResult(config, out=out)
    sims = hp.sim_fleet(config.backends, out / "logs", profile=config.profile,
                       kv_events=config.mode != "approximate")  # fmt: skip
    overrides = {"limits": {"max_body_bytes": config.max_body_bytes}}
    wall0 = time.monotonic()
    async with hp.sims_and_router(sims, mode=config.mode, overrides=overrides,
                                 logs=out / "logs") as router:  # fmt: skip
        load = h.MixedLoad(router.url, config.profile, seed=config.seed, users=config.users,
                           max_body_bytes=config.max_body_bytes)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await _run_load(config, result, sims, router, load, session, notify)
            result.router_alive = router.returncode is None
            if result.router_alive:
                await h.wait_load_zero(session, router.url, config.settle_s)
                result.final = await _sample(session, router, load, load.now())
    result.wall_s = time.monotonic() - wall0
    _judge(result, load.shots)
    return result


async def _run_load(
    config: SoakConfig, result: SoakResult, sims: list[hp.SimProcess], router: hp.RouterProcess,
    load: h.MixedLoad, session: aiohttp.ClientSession, notify: Notify | None,
) -> None:  # fmt: skip
    stop = asyncio.Event()
    t0 = time.monotonic()
    load_task = asyncio.create_task(load.run(stop, t0))
    restarts = asyncio.create_task(_restarts(config, sims, result, stop, t0))
    try:
        next_at = t0
        while (now := time.monotonic()) - t0 < config.duration_s:
            if router.returncode is not None:
                break
            if now >= next_at:
                next_at += config.sample_s
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    sample = await _sample(session, router, load, now - t0)
                    result.samples.append(sample)
                    if notify is not None:
                        notify(sample, result)
            wake = min(next_at, t0 + config.duration_s)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
    finally:
        stop.set()
        await restarts
        await load_task


async def _restarts(
    config: SoakConfig, sims: list[hp.SimProcess], result: SoakResult, stop: asyncio.Event,
    t0: float,
) -> None:  # fmt: skip
    """Kill backend k % n at every multiple k of restart_every_s; start it again."""
    if config.restart_every_s <= 0:
        return
    k = 0
    while True:
        k += 1
        due = t0 + k * config.restart_every_s
        if due >= t0 + config.duration_s:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), due - time.monotonic())
            return
        victim = sims[(k - 1) % len(sims)]
        victim.kill()
        kill_s = time.monotonic() - t0
        await victim.stop()
        await asyncio.sleep(config.restart_down_s)
        ready_s: float | None = None
        with contextlib.suppress(RuntimeError, TimeoutError):
            await victim.start()
            ready_s = time.monotonic() - t0
        result.restarts.append(Restart(victim.index, kill_s, ready_s))


async def _sample(
    session: aiohttp.ClientSession, router: hp.RouterProcess, load: h.MixedLoad, t_s: float
) -> Sample:
    assert router.pid is not None, "sampled only while the router runs"
    rss, fds = h.proc_figures(router.pid)
    m = await h.scrape(session, router.url)
    return Sample(
        t_s=round(t_s, 3),
        rss_mib=round(rss, 2),
        fds=fds,
        index_blocks=h.total(m, "kvroute_index_blocks"),
        tasks=h.total(m, TASKS_GAUGE),
        in_flight_requests=h.total(m, "kvroute_backend_router_in_flight_requests") or 0.0,
        in_flight_tokens=h.total(m, "kvroute_backend_in_flight_tokens") or 0.0,
        router_in_flight=h.total(m, ROUTER_IN_FLIGHT_GAUGE),
        num_done=load.stats.done,
        num_failed=sum(load.stats.by_failure.values()),
    )


def _judge(result: SoakResult, shots: Sequence[h.Shot]) -> None:
    config = result.config
    kills = [r.kill_s for r in result.restarts]
    classes = [classify(s, kills) for s in shots]
    result.outcomes = h.count_by(classes, lambda c: c)
    failed = [s for s, c in zip(shots, classes, strict=True) if c == "failed"]
    result.failures = h.count_by(failed, lambda s: f"{s.kind}: {s.failure}")
    result.failed_examples = [asdict(s) for s in failed[:10]]
    result.flat = flatness(result.samples, config.resolved_warmup_s, config.tolerance)
    final = result.final
    if final is None:
        result.leaked = {"router": float("nan")}  # died or never settled: nothing to read
    else:
        result.leaked = {
            "in_flight_requests": final.in_flight_requests,
            "in_flight_tokens": final.in_flight_tokens,
        }
        if final.router_in_flight is not None:
            result.leaked["router_in_flight"] = final.router_in_flight


# ---- outputs -----------------------------------------------------------------------


def write_outputs(result: SoakResult) -> dict[str, Path]:
    """soak.json (everything) and soak.png (each series over time) in ``result.out``."""
    assert result.out is not None, "run_soak sets the output folder"
    paths = {"json": result.out / "soak.json", "plot": result.out / "soak.png"}
    paths["json"].write_text(json.dumps(result.to_json(), indent=1, default=str))
    plot_samples(result, paths["plot"])
    return paths


def plot_samples(result: SoakResult, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = {
        "rss_mib": "router RSS (MiB)", "fds": "open file descriptors",
        "index_blocks": "index blocks", "tasks": "asyncio tasks",
        "in_flight_requests": "in-flight requests", "in_flight_tokens": "in-flight tokens",
    }  # fmt: skip
    names = [n for n in SERIES if any(getattr(s, n) is not None for s in result.samples)]
    fig = Figure(figsize=(11, 2.2 * len(names) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    t = [s.t_s / 60 for s in result.samples]
    warm = result.config.resolved_warmup_s / 60
    for ax, name in zip(axes, names, strict=True):
        ax.plot(t, [getattr(s, name) for s in result.samples], color="tab:blue", lw=1.2)
        ax.axvspan(0, warm, color="grey", alpha=0.15)
        verdict = result.flat.get(name)
        if verdict and "limit" in verdict:
            ax.axhline(verdict["limit"], ls="--", color="tab:red", lw=0.8)
        for r in result.restarts:
            ax.axvline(r.kill_s / 60, color="tab:orange", lw=0.6, alpha=0.6)
        ax.set_ylabel(labels[name], fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (grey: warm-up; orange: backend killed; red: flat limit)")
    verdict = "PASS" if result.passed else "FAIL"
    fig.suptitle(f"kvroute soak: {result.config.duration_s / 60:g} min, "
                 f"{result.config.mode} mode, {verdict}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
