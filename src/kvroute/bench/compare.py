"""``run_compare``: the same workload against several routers, each on a fresh fleet.

For each router in turn: start a simulated fleet (one ``kvroute sim`` process, same
profile and seed every time), start the router in front of it (its own process, its own
command line), run the workload with the load generator in this process, then stop both.
Seeds, workload and load are identical across routers, so only the router differs.

A router that is not installed is reported as skipped; a router that fails to start or
run is reported with its error; neither stops the others. Teardown always happens:
processes are stopped in ``finally`` blocks (also on Ctrl-C and SIGTERM), and an
``atexit`` hook (bench/procs.py) kills any that survive an abrupt exit of the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench.decisions import analyze
from kvroute.bench.load import LoadConfig, default_load
from kvroute.bench.metrics import RequestRecord, measured
from kvroute.bench.procs import (
    ManagedProcess,
    RouterSpec,
    RouterUnavailable,
    check_router_config,
    error_line,
    free_port,
    free_port_range,
    parse_router,
    router_command,
    sim_command,
)
from kvroute.bench.progress import rich_progress
from kvroute.bench.runner import BenchResult, discover_model, run_benchmark
from kvroute.bench.timescale import TimeScaled, scale_load
from kvroute.bench.workloads import Workload, make_workload
from kvroute.sim.profiles import get_profile

BASELINE = "round_robin"  # ratios in the report are taken against this router


@dataclass(frozen=True, slots=True)
class CompareConfig:
    """One comparison: which routers, which fleet, which workload and load."""

    workload: str  # workload name, as for ``kvroute bench``
    routers: tuple[str, ...]  # names for parse_router, in run order
    num_backends: int = 8  # simulated engines per fleet
    profile: str = "codellama-13b-a100-40g"  # engine profile of every engine
    speedup: float = 1.0  # engines run X times faster; client pauses divided by X
    seed: int = 0  # workload, load and sim seed: the same for every router
    workload_overrides: Mapping[str, str] = field(default_factory=dict)  # --workload-arg
    load_overrides: Mapping[str, Any] = field(default_factory=dict)  # LoadConfig fields
    trace_path: str | None = None  # for plain ``mooncake`` or ``azure``
    sim_args: tuple[str, ...] = ()  # extra ``kvroute sim`` arguments (e.g. --jitter 0.05)
    log_dir: Path | None = None  # process logs; None: a temporary folder
    startup_timeout_s: float = 60.0  # fleet and router each must be ready within this
    progress: bool = True  # a rich progress bar per router (stderr)
    # a kvroute YAML (fleet, cost, policies...) for every kvroute router; its backends are
    # the simulated fleet's, so the file lists none
    router_config: str | None = None

    def __post_init__(self) -> None:
        if not self.routers:
            raise ValueError("CompareConfig.routers must name at least one router")
        if self.num_backends < 1:
            raise ValueError("CompareConfig.num_backends must be >= 1")
        if not self.speedup > 0:
            raise ValueError("CompareConfig.speedup must be > 0")
        if not self.startup_timeout_s > 0:
            raise ValueError("CompareConfig.startup_timeout_s must be > 0")
        get_profile(self.profile)  # ValueError for an unknown profile, before anything starts
        # ValueError for an unknown name, before anything starts
        specs = [parse_router(name) for name in self.routers]
        if self.router_config is not None:
            check_router_config(self.router_config, specs)


@dataclass(slots=True)
class RouterOutcome:
    """What happened to one router of the comparison (exactly one of the three is set)."""

    name: str  # as written in --routers
    bench: BenchResult | None = None  # the run, when it completed
    skipped: str | None = None  # why it was not run (not installed)
    error: str | None = None  # why its run failed

    def to_json(self) -> dict[str, Any]:
        """compare.json's value for this router: the result, or why there is none."""
        if self.bench is not None:
            return self.bench.result
        if self.skipped is not None:
            return {"router": self.name, "skipped": self.skipped}
        return {"router": self.name, "error": self.error}


def build_workload(config: CompareConfig) -> Workload:
    """A fresh instance (same seed, so the same requests), scaled to the engines' speed."""
    inner = make_workload(
        config.workload,
        seed=config.seed,
        overrides=dict(config.workload_overrides),
        trace_path=config.trace_path,
    )
    return TimeScaled(inner, config.speedup)


def spread_note(workload: Workload) -> str | None:
    """What a trace replay does to timestamps it finds quantised (most rows share one),
    unless ``spread_ms`` was given: the user should know their arrivals were moved."""
    inner = getattr(workload, "inner", workload)
    bucket = getattr(inner, "bucket_ms", 0.0)
    if not bucket or getattr(inner.params, "spread_ms", None) is not None:
        return None
    return (
        f"the trace's timestamps look quantised to {bucket:g} ms (most rows share one): "
        f"each row arrives at a uniform point of its {bucket:g} ms; "
        "--workload-arg spread_ms=0 replays them as written"
    )


def build_load(config: CompareConfig, workload: Workload, model: str | None = None) -> LoadConfig:
    """The workload's default load with the overrides, scaled to the engines' speed.

    ``model`` (asked of an engine, since a peer router may not list the fleet's models)
    is used unless the overrides name one.
    """
    fields = {"seed": config.seed, "model": model, **config.load_overrides}
    return scale_load(default_load(workload, **fields), config.speedup)


def safe_name(router: str) -> str:
    """A router name usable as a folder name (``kvroute:least_load`` -> ``kvroute-least_load``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", router)


# --- processes ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def managed(name: str, cmd: list[str], log_path: Path) -> Any:
    """Start ``cmd`` as a ManagedProcess and always stop it on the way out."""
    proc = ManagedProcess(name, cmd, log_path)
    try:
        await proc.start()
        yield proc
    finally:
        await asyncio.shield(proc.stop())


@contextlib.contextmanager
def sigterm_cancels() -> Iterator[None]:
    """While inside, SIGTERM cancels the current task (so ``finally`` blocks tear down)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    try:
        loop.add_signal_handler(signal.SIGTERM, lambda: task and task.cancel())
    except (NotImplementedError, RuntimeError):  # not the main thread: no handler
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


# --- one router ---------------------------------------------------------------------


async def _router_metrics(url: str) -> str | None:
    """The router's own /metrics text (decision reasons), when it serves one."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
        timeout = aiohttp.ClientTimeout(total=5)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url + "/metrics") as resp,
        ):
            if resp.status == 200:
                return await resp.text()
    return None


async def _engine_model(url: str) -> str | None:
    async with aiohttp.ClientSession() as session:
        return await discover_model(session, url)


def decision_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Measured requests per ``x-kvroute-decision`` reason (empty for routers without it)."""
    return dict(Counter(r.decision for r in measured(records) if r.decision))


async def run_one(
    config: CompareConfig, spec: RouterSpec, log_dir: Path
) -> tuple[BenchResult, str | None]:
    """Fleet up, router up, the run, both down. Returns the result and the router's /metrics."""
    n = config.num_backends
    port_base = free_port_range(n)
    backends = [f"http://127.0.0.1:{port_base + i}" for i in range(n)]
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    kv_args: list[str] = []
    kv_endpoints: list[str] = []
    if spec.mode == "exact":  # the fleet publishes KV events, the router subscribes
        kv_base = free_port_range(n, start=port_base + n)
        kv_args = ["--kv-events", "--kv-port-base", str(kv_base)]
        kv_endpoints = [f"tcp://127.0.0.1:{kv_base + i}" for i in range(n)]
    # RouterUnavailable before anything starts
    router_cmd = router_command(spec, backends, router_port, kv_endpoints, config.router_config)
    sim_cmd = sim_command(n, port_base, config.profile, config.speedup, config.sim_args)
    sim_cmd += kv_args
    sim_cmd += ["--seed", str(config.seed)]
    stem = safe_name(spec.name)
    async with managed(f"sim for {spec.name}", sim_cmd, log_dir / f"{stem}-sim.log") as sim:
        await sim.wait_ready([u + "/health" for u in backends], config.startup_timeout_s)
        async with managed(spec.name, router_cmd, log_dir / f"{stem}-router.log") as router:
            await router.wait_ready([router_url + "/health"], config.startup_timeout_s)
            workload = build_workload(config)
            load = build_load(config, workload, await _engine_model(backends[0]))
            label = f"{spec.name:<16}"
            with rich_progress(
                label, load.num_requests, load.duration_s, enabled=config.progress
            ) as progress:
                bench = await run_benchmark(
                    router_url,
                    workload,
                    load,
                    backends,
                    router=spec.name,
                    progress=progress,
                    target_is_backend=False,
                    extra_config=_extra_config(config, spec, router_cmd),
                    block_size=get_profile(config.profile).block_size,  # for the ceiling
                )
            metrics_text = await _router_metrics(router_url)
            if router.returncode is not None:
                raise RuntimeError(f"{spec.name} exited during the run:\n{router.tail()}")
    add_decision_analysis(bench)
    return bench, metrics_text


def add_decision_analysis(bench: BenchResult) -> None:
    """``router_decisions`` and, for routers that say why they routed each request,
    ``decision_analysis`` (bench/decisions.py) into the result."""
    bench.result["router_decisions"] = decision_counts(bench.records)
    analysis = analyze(bench.records)  # None for routers that send no decision header
    if analysis is not None:
        bench.result["decision_analysis"] = analysis.to_json()


def _extra_config(config: CompareConfig, spec: RouterSpec, router_cmd: list[str]) -> dict:
    return {
        "speedup": config.speedup,
        "time_unit": "wall seconds (engine time = speedup x wall)",
        "profile": config.profile,
        "num_backends": config.num_backends,
        "router_kind": spec.kind,
        "router_policy": spec.policy,
        "router_command": " ".join(router_cmd),
        "seed": config.seed,
    }


# --- the comparison -----------------------------------------------------------------

Notify = Callable[[str], None]


async def run_compare_async(
    config: CompareConfig, notify: Notify | None = None
) -> dict[str, RouterOutcome]:
    """Every router of ``config`` in order; ``notify`` gets one line per router event."""
    say = notify or (lambda _msg: None)
    workload = build_workload(config)
    build_load(config, workload)  # bad workload or load: ValueError now
    if note := spread_note(workload):
        say(note)
    outcomes: dict[str, RouterOutcome] = {}
    with contextlib.ExitStack() as stack:
        log_dir = config.log_dir
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-")))
        stack.enter_context(sigterm_cancels())
        for name in config.routers:
            outcome = RouterOutcome(name)
            outcomes[name] = outcome
            try:
                bench, metrics_text = await run_one(config, parse_router(name), log_dir)
            except RouterUnavailable as exc:
                outcome.skipped = str(exc)
                say(f"{name}: skipped ({exc})")
                continue
            except (RuntimeError, TimeoutError, OSError) as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"
                say(f"{name}: failed ({error_line(exc)})")
                continue
            outcome.bench = bench
            if metrics_text is not None and config.log_dir is not None:
                (config.log_dir / f"{safe_name(name)}-router-metrics.txt").write_text(metrics_text)
    return outcomes


def run_compare(config: CompareConfig, notify: Notify | None = None) -> dict[str, RouterOutcome]:
    """Blocking ``run_compare_async`` in a fresh event loop."""
    return asyncio.run(run_compare_async(config, notify))
