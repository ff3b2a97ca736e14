"""Chaos: a seeded schedule of backend faults while a mixed load runs through kvroute in
exact mode; the report counts requests by outcome and checks the invariants at the end.

The fleet is N simulators (one process each, KV events with replay) behind a real
``kvroute serve --mode exact`` with short health, breaker and timeout settings
(``ROUTER_OVERRIDES``), so faults are noticed and forgiven within seconds. The faults,
their seeded schedule and the attribution of failures to them are bench/chaos_faults.py's.

After the schedule: every fault is cleared and every backend is up; a light load runs
until every circuit lets traffic through again; then the load stops. Invariants:

- **no leaked load**: the router's in-flight requests and tokens return to 0;
- **breakers consistent**: every backend answers /health 200 and the router shows it
  healthy with a circuit that is not open: closed, or half-open (its open time is over
  and its trial request goes out when the policy next picks it; under a light load the
  policy may keep sending every prefix to the backends holding it, so a half-open
  circuit can wait for traffic, routable all the while);
- **exact mode recovers**: every backend's KV feed is up and its view exact. A backend
  whose stream lost batches for good stays approximate until its engine's cache is
  cleared (core/kv_sync.py), so such a backend gets ``POST /reset_prefix_cache`` first,
  as an operator would; the report lists which needed it;
- the router process is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench import hardening as h
from kvroute.bench import harness_procs as hp
from kvroute.bench.chaos_faults import FAULT_KINDS, FaultEvent, attribute, make_schedule, outcome_of
from kvroute.router.breaker import CircuitState

ROUTER_OVERRIDES: dict[str, Any] = {
    "health": {
        "interval_s": 0.5,
        "timeout_s": 0.5,
        "unhealthy_after": 2,
        "healthy_after": 1,
        "scrape_interval_s": 1.0,
    },
    "breaker": {"failure_threshold": 3, "open_s": 2.0},
    "timeouts": {"first_byte_s": 4.0, "idle_s": 3.0, "response_s": 6.0},
    "limits": {"max_body_bytes": 262_144},
}


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    duration_s: float = 60.0  # load time under the schedule
    seed: int = 0
    backends: int = 3
    users: int = 6
    kinds: tuple[str, ...] = FAULT_KINDS
    mean_gap_s: float = 2.0  # mean time between fault starts (exponential)
    fault_s: tuple[float, float] = (2.0, 6.0)  # a fault lasts uniformly this long
    recovery_s: float = 30.0  # after the schedule: time for circuits and views to recover
    settle_s: float = 15.0  # after the load: time for in-flight load to reach 0
    profile: str = "tiny"
    out: Path | None = None

    def __post_init__(self) -> None:
        if self.backends < 2:
            raise ValueError("backends must be >= 2 (one stays fault-free at any time)")
        if not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.users < 1:
            raise ValueError("users must be >= 1")


@dataclass
class ChaosResult:
    config: ChaosConfig
    schedule: list[FaultEvent]
    applied: list[dict[str, Any]] = field(default_factory=list)  # what was done, when
    outcomes: dict[str, int] = field(default_factory=dict)  # over the chaos phase
    failures_by_fault: dict[str, int] = field(default_factory=dict)
    failures_outside_faults: int = 0  # failures overlapping no fault window (+ grace)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per fault kind
    invariants: dict[str, dict[str, Any]] = field(default_factory=dict)
    needed_reset: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    out: Path | None = None

    @property
    def passed(self) -> bool:
        return bool(self.invariants) and all(v["ok"] for v in self.invariants.values())

    def to_json(self) -> dict[str, Any]:
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()}
        return {
            "config": cfg,
            "passed": self.passed,
            "invariants": self.invariants,
            "outcomes": self.outcomes,
            "failures_by_fault": self.failures_by_fault,
            "failures_outside_faults": self.failures_outside_faults,
            "examples": self.examples,
            "needed_reset": self.needed_reset,
            "schedule": [asdict(e) for e in self.schedule],
            "applied": self.applied,
            "wall_s": self.wall_s,
        }


# ---- the run -----------------------------------------------------------------------

Notify = Callable[[str], None]


async def run_chaos(config: ChaosConfig, notify: Notify | None = None) -> ChaosResult:
    say = notify or (lambda _: None)
    out = config.out or Path(tempfile.mkdtemp(prefix="kvroute-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    schedule = make_schedule(
        config.seed, config.backends, config.duration_s, kinds=config.kinds,
        mean_gap_s=config.mean_gap_s, fault_s=config.fault_s,
    )  # fmt: skip
    result = ChaosResult(config, schedule, out=out)
    sims = hp.sim_fleet(config.backends, out / "logs", profile=config.profile)
    wall0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        hp.sims_and_router(
            sims, mode="exact", overrides=ROUTER_OVERRIDES, logs=out / "logs"
        ) as router,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        await _wait_exact(session, router.url, 15.0)  # start from a synced fleet
        say(f"fleet up: {len(sims)} backends, router {router.url}; "
            f"{len(schedule)} faults over {config.duration_s:g} s")  # fmt: skip
        load = h.MixedLoad(router.url, config.profile, seed=config.seed, users=config.users,
                           client_timeout_s=20.0)  # fmt: skip
        stop = asyncio.Event()
        t0 = time.monotonic()
        load_task = asyncio.create_task(load.run(stop, t0))
        try:
            await _play(schedule, sims, session, t0, result, say)
            await asyncio.sleep(max(0.0, t0 + config.duration_s - time.monotonic()))
        finally:
            stop.set()
            await load_task
        shots = list(load.shots)
        say(f"schedule over: {len(shots)} requests; recovering")
        await _recover(config, sims, router, session, result, say)
    result.wall_s = time.monotonic() - wall0
    result.outcomes = h.count_by(shots, outcome_of)
    grace = ROUTER_OVERRIDES["breaker"]["open_s"] + 1.0
    counts, failed = attribute(shots, schedule, grace, [sim.url for sim in sims])
    result.failures_outside_faults = counts.pop("none", 0)
    result.failures_by_fault = counts
    result.examples = {k: [asdict(s) for s in v[:3]] for k, v in failed.items()}
    return result


async def _play(
    schedule: Sequence[FaultEvent], sims: Sequence[hp.SimProcess],
    session: aiohttp.ClientSession, t0: float, result: ChaosResult, say: Notify,
) -> None:  # fmt: skip
    """Apply and revert each fault at its time (one action at a time, in time order)."""
    actions = sorted(
        [(e.start_s, 1, e) for e in schedule] + [(e.end_s, 0, e) for e in schedule],
        key=lambda a: (a[0], a[1]),
    )
    for at_s, is_start, event in actions:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
        sim = sims[event.backend]
        what = (
            f"{'start' if is_start else 'end'} {event.kind} {event.change or ''} on {event.backend}"
        )
        try:
            if event.kind == "kill":
                if is_start:
                    sim.kill()
                    await sim.stop()
                else:
                    await sim.start()
            elif is_start:
                await _post_faults(session, sim, event.change)
            else:
                await _clear_faults(session, sim)
            error = None
        except (aiohttp.ClientError, TimeoutError, RuntimeError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        done_s = time.monotonic() - t0
        result.applied.append({"at_s": round(done_s, 3), "action": what, "error": error})
        say(f"{done_s:6.1f} s  {what}{'  ERROR ' + error if error else ''}")


async def _post_faults(session: aiohttp.ClientSession, sim: hp.SimProcess, change: dict) -> None:
    async with session.post(f"{sim.url}/sim/faults", json=change) as resp:
        resp.raise_for_status()


async def _clear_faults(session: aiohttp.ClientSession, sim: hp.SimProcess) -> None:
    async with session.delete(f"{sim.url}/sim/faults") as resp:
        resp.raise_for_status()


async def _recover(
    config: ChaosConfig, sims: Sequence[hp.SimProcess], router: hp.RouterProcess,
    session: aiohttp.ClientSession, result: ChaosResult, say: Notify,
) -> None:  # fmt: skip
    """Clear everything, let circuits close under a light load, then check invariants."""
    for sim in sims:
        if not sim.alive:
            await sim.start()
        await _clear_faults(session, sim)
    inv = result.invariants
    valid_only = {k: v for k, v in h.DEFAULT_MIX.items() if k not in h.MALFORMED}
    light = h.MixedLoad(router.url, config.profile, seed=config.seed + 1, users=2,
                        mix=valid_only, client_timeout_s=10.0)  # fmt: skip
    stop = asyncio.Event()
    light_task = asyncio.create_task(light.run(stop))
    try:
        closed = await _poll(session, router.url, config.recovery_s, _all_routable)
    finally:
        stop.set()
        await light_task
    health = {s.url: await _direct_health(session, s.url) for s in sims}
    m = await h.scrape(session, router.url)
    inv["breakers_consistent"] = {
        "ok": closed and all(code == 200 for code in health.values()),
        "backend_health": health,
        "router_healthy": h.per_backend(m, "kvroute_backend_healthy"),
        "circuit_state": h.per_backend(m, "kvroute_backend_circuit_state"),
    }
    say(f"circuits not open: {closed}")
    zero = await h.wait_load_zero(session, router.url, config.settle_s)
    reqs, tokens = await h.router_load(session, router.url)
    inv["no_leaked_load"] = {"ok": zero, "in_flight_requests": reqs, "in_flight_tokens": tokens}
    m = await h.scrape(session, router.url)
    for url, exact in h.per_backend(m, "kvroute_backend_kv_exact").items():
        if exact != 1:
            result.needed_reset.append(url)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(f"{url}/reset_prefix_cache"):
                    pass
    synced = await _wait_exact(session, router.url, 10.0)
    m = await h.scrape(session, router.url)
    inv["exact_recovers"] = {
        "ok": synced,
        "kv_exact": h.per_backend(m, "kvroute_backend_kv_exact"),
        "kv_feed_up": h.per_backend(m, "kvroute_backend_kv_feed_up"),
        "kv_gaps": h.per_backend(m, "kvroute_backend_kv_gaps"),
        "kv_restarts": h.per_backend(m, "kvroute_backend_kv_restarts"),
    }
    inv["router_alive"] = {"ok": router.returncode is None}
    say(f"exact again: {synced} (reset: {result.needed_reset or 'none'})")


def _all_routable(m: dict[str, dict[str, float]]) -> bool:
    healthy = h.per_backend(m, "kvroute_backend_healthy")
    circuits = h.per_backend(m, "kvroute_backend_circuit_state")
    return (
        bool(healthy)
        and all(v == 1 for v in healthy.values())
        and all(v != CircuitState.OPEN for v in circuits.values())
    )


def _all_exact(m: dict[str, dict[str, float]]) -> bool:
    exact = h.per_backend(m, "kvroute_backend_kv_exact")
    feeds = h.per_backend(m, "kvroute_backend_kv_feed_up")
    return bool(exact) and all(v == 1 for v in [*exact.values(), *feeds.values()])


async def _wait_exact(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    return await _poll(session, url, timeout_s, _all_exact)


async def _poll(
    session: aiohttp.ClientSession, url: str, timeout_s: float,
    cond: Callable[[dict[str, dict[str, float]]], bool],
) -> bool:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            if cond(await h.scrape(session, url)):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.25)


async def _direct_health(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(f"{url}/health") as resp:
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None


def write_report(result: ChaosResult) -> Path:
    assert result.out is not None, "run_chaos sets the output folder"
    path = result.out / "chaos.json"
    path.write_text(json.dumps(result.to_json(), indent=1, default=str))
    return path
