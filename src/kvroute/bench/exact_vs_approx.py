"""Exact vs approximate routing on the simulator: engine-measured prefix hit rate, TTFT,
throughput, and whether the router's per-backend view matches the engines' block sets.

Per workload and mode: a fresh ``kvroute sim --kv-events --kv-replay`` fleet, a fresh
``kvroute serve --mode MODE`` router in front of it (endpoints given with ``--kv-events
URL=EP --kv-replay URL=EP``), an ``EventFollower`` (bench/kv_view.py) that follows the
same event streams from seq 0, and the workload through ``run_benchmark``. After the run
the router's ``GET /admin/kv`` is compared with the follower per backend (held blocks
and a digest of the keys); in approximate mode the router's index block count is shown
next to the engines'.

    python -m kvroute.bench.exact_vs_approx --workloads ranvier-stress,gsp,mooncake \\
        --backends 8 --profile codellama-13b-a100-40g --speedup 4 --duration 75

(``scripts/exact_vs_approx.py`` runs the same.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvroute.bench.compare import CompareConfig, build_load, build_workload, decision_counts
from kvroute.bench.kv_view import EventFollower, settled_views, view_check, wait_exact
from kvroute.bench.procs import (
    KVROUTE,
    SIM_LINE,
    ManagedProcess,
    SimEngine,
    free_port,
    free_port_range,
    sim_command,
    sim_engines,
)
from kvroute.bench.runner import run_benchmark
from kvroute.bench.workloads import is_trace_replay

ADMIN_KEY = "exact-vs-approx-admin"


def router_cmd(mode: str, engines: list[SimEngine], port: int) -> list[str]:
    cmd = [*KVROUTE, "serve", "--policy", "prefix", "--mode", mode]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--admin-key", ADMIN_KEY]
    for e in engines:
        cmd += ["--backend", e.url, "--kv-events", f"{e.url}={e.kv_events}"]
        if e.kv_replay:
            cmd += ["--kv-replay", f"{e.url}={e.kv_replay}"]
    return cmd


async def one_run(args: argparse.Namespace, workload: str, mode: str, log_dir: Path) -> dict:
    n = args.backends
    http_base = free_port_range(n, 21000, 40000)
    kv_base = free_port_range(n, 40000, 60000)
    extra = ["--kv-events", "--kv-port-base", str(kv_base), "--kv-replay"]
    sim = ManagedProcess(
        "sim", sim_command(n, http_base, args.profile, args.speedup, extra), log_dir / "sim.log"
    )
    router: ManagedProcess | None = None
    follower: EventFollower | None = None
    try:
        await sim.start()
        engines = sim_engines(await sim.wait_line(SIM_LINE, 60, count=n))
        await sim.wait_ready([e.url + "/health" for e in engines], 60)
        follower = EventFollower(engines)
        follower.start()
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        router = ManagedProcess("router", router_cmd(mode, engines, port), log_dir / "router.log")
        await router.start()
        await router.wait_ready([router_url + "/health"], 60)
        if mode != "approximate":
            await wait_exact(router_url, ADMIN_KEY)
        config = compare_config(args, workload)
        wl = build_workload(config)
        load = build_load(config, wl, model=None)
        bench = await run_benchmark(
            router_url,
            wl,
            load,
            [e.url for e in engines],
            router=f"kvroute:{mode}",
            target_is_backend=False,
        )
        exact = mode != "approximate"
        kv, snap = await settled_views(router_url, ADMIN_KEY, follower, exact=exact)
        result = bench.result
        return {
            "workload": workload,
            "mode": mode,
            "completed": result["completed"],
            "failed": result["failed"],
            "engine_hit_rate": result.get("engine_prefix_hit_rate"),
            "p50_ttft_ms": result.get("p50_ttft_ms", result.get("median_ttft_ms")),
            "p99_ttft_ms": result.get("p99_ttft_ms"),
            "req_per_s": result["request_throughput"],
            "out_tok_per_s": result["output_throughput"],
            "decisions": decision_counts(bench.records),
            "checker_gaps": sum(v["gaps"] or 0 for v in snap.values()),
            **view_check(kv, snap, exact=exact),
        }
    finally:
        if follower is not None:
            follower.stop()
        for proc in (router, sim):
            if proc is not None:
                await proc.stop()


def compare_config(args: argparse.Namespace, workload: str) -> CompareConfig:
    overrides: dict[str, str] = {}
    load: dict[str, Any] = {"duration_s": args.duration}
    if is_trace_replay(workload):
        overrides = {
            "max_requests": str(args.max_requests),
            "input_scale": str(args.input_scale),
            "output_cap": str(args.output_cap),
            "speedup": str(args.trace_speedup),
        }
        load = {}  # a trace replay ends with its rows
    return CompareConfig(
        workload=workload,
        routers=("kvroute",),
        num_backends=args.backends,
        profile=args.profile,
        speedup=args.speedup,
        seed=args.seed,
        workload_overrides=overrides,
        load_overrides=load,
    )


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<16}{'mode':<13}{'done':>6}{'fail':>5}{'hit %':>8}{'p50 TTFT':>10}"
        f"{'p99 TTFT':>10}{'req/s':>8}{'tok/s':>8}  view (router/engine blocks, equal)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        hit = None if r["engine_hit_rate"] is None else 100 * r["engine_hit_rate"]
        view = f"{r['router_blocks']}/{r['engine_blocks']}, {r['backends_equal']}"
        print(
            f"{r['workload']:<16}{r['mode']:<13}{r['completed']:>6}{r['failed']:>5}"
            f"{_fmt(hit, '.1f'):>8}{_fmt(r['p50_ttft_ms'], '.0f'):>10}"
            f"{_fmt(r['p99_ttft_ms'], '.0f'):>10}{_fmt(r['req_per_s'], '.2f'):>8}"
            f"{_fmt(r['out_tok_per_s'], '.0f'):>8}  {view}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="ranvier-stress,gsp,mooncake")
    p.add_argument("--modes", default="approximate,exact")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--profile", default="codellama-13b-a100-40g")
    p.add_argument("--speedup", type=float, default=4.0, help="sim speedup (load scaled too)")
    p.add_argument("--duration", type=float, default=75.0, help="seconds per synthetic run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=600, help="mooncake rows")
    p.add_argument("--input-scale", type=float, default=0.25, help="mooncake prompt scale")
    p.add_argument("--output-cap", type=int, default=64, help="mooncake max_tokens cap")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="mooncake arrival speedup")
    p.add_argument("--out", default=None, help="folder for logs and results.json")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="exact-vs-approx-"))
    rows = []
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            row = await one_run(args, workload, mode, out / f"{workload}-{mode}")
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print()
    print_table(rows)
    print(f"\nlogs and results.json in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
