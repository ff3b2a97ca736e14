"""Exact vs approximate routing on the simulator: engine-measured prefix hit rate, TTFT,
throughput, and whether the router's per-backend view matches the engines' block sets.

Per workload and mode: a fresh ``kvroute sim --kv-events --kv-replay`` fleet, a fresh
``kvroute serve --mode MODE`` router in front of it (endpoints given with ``--kv-events
URL=EP --kv-replay URL=EP``), a checker in this process (its own thread and event loop)
that follows the same event streams from seq 0 into an exact-mode Fleet, and the
workload through ``run_benchmark``. After the run the router's ``GET /admin/kv`` is
compared with the checker, per backend: held (confirmed) block count and a digest of the
keys. (That the event view equals the engine's own block set is proven by
tests/exact/test_kv_subscriber.py; here the check is that the live router applied every
event.) In approximate mode the router's index block count is shown next to the engines'.

    .venv/bin/python scripts/exact_vs_approx.py --workloads ranvier-stress,gsp,mooncake \\
        --backends 8 --profile codellama-13b-a100-40g --speedup 4 --duration 75
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench.compare import CompareConfig, build_load, build_workload, decision_counts
from kvroute.bench.procs import ManagedProcess, free_port, free_port_range, sim_command
from kvroute.bench.runner import run_benchmark
from kvroute.core.fleet import Fleet, FleetConfig
from kvroute.core.policy import make_policy
from kvroute.router.kv_subscriber import KvEventSubscriber

ADMIN_KEY = "exact-vs-approx-admin"
LINE = re.compile(r"backend (\d+): (\S+)\s+kv-events (\S+)(?:\s+replay (\S+))?")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """One simulated engine as the sim printed it."""

    url: str  # HTTP base URL
    kv_events: str  # PUB endpoint
    kv_replay: str | None  # ROUTER endpoint


class Checker:
    """Follows every engine's KV events in a thread of its own (off the client's loop)."""

    def __init__(self, engines: list[Endpoints]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.fleet = Fleet(make_policy("round_robin"), FleetConfig(mode="exact"))
        for e in engines:
            self.fleet.add_backend(e.url)
        events = {e.url: e.kv_events for e in engines}
        replay = {e.url: e.kv_replay for e in engines if e.kv_replay}
        self.sub = KvEventSubscriber(self.fleet, events, replay)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def start(self) -> None:
        self.thread.start()
        self._call(self.sub.start())

    def stop(self) -> None:
        self._call(self.sub.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        async def snap() -> dict[str, dict[str, Any]]:
            out = {}
            for url in self.fleet.urls():
                model = self.fleet.sync.model(url)
                status = self.sub.status(url)
                out[url] = {
                    "exact": model is not None,
                    "last_seq": status.last_seq if status else None,
                    "gaps": status.num_gaps if status else None,
                    "blocks": model.num_confirmed if model is not None else None,
                    "digest": str(sum(model.confirmed_keys()) % 2**64)
                    if model is not None
                    else None,
                }
            return out

        return self._call(snap())  # type: ignore[no-any-return]


def parse_sim_log(text: str, n: int) -> list[Endpoints]:
    found = {int(m[1]): Endpoints(m[2], m[3], m[4]) for m in LINE.finditer(text)}
    if len(found) < n:
        raise RuntimeError(f"sim printed {len(found)} of {n} backend lines:\n{text}")
    return [found[i] for i in range(n)]


async def sim_endpoints(sim: ManagedProcess, n: int, timeout_s: float = 60) -> list[Endpoints]:
    deadline = time.monotonic() + timeout_s
    while True:
        text = sim.log_path.read_text(errors="replace") if sim.log_path.exists() else ""
        if len(LINE.findall(text)) >= n:
            return parse_sim_log(text, n)
        if sim.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sim not ready:\n{sim.tail()}")
        await asyncio.sleep(0.2)


def router_cmd(mode: str, engines: list[Endpoints], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--policy", "prefix", "--mode", mode]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--admin-key", ADMIN_KEY]
    for e in engines:
        cmd += ["--backend", e.url, "--kv-events", f"{e.url}={e.kv_events}"]
        if e.kv_replay:
            cmd += ["--kv-replay", f"{e.url}={e.kv_replay}"]
    return cmd


async def admin_kv(router_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
        s.get(router_url + "/admin/kv", headers=headers) as r,
    ):
        return await r.json()  # type: ignore[no-any-return]


async def wait_exact(router_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = (await admin_kv(router_url))["backends"]
        if rows and all(r["mode"] == "exact" for r in rows):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("router did not sync every backend's KV events in time")


async def settled_views(
    router_url: str, checker: Checker, exact: bool, timeout_s: float = 20
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Router and checker views once both applied the same last batch (or time is up)."""
    deadline = time.monotonic() + timeout_s
    prev: dict[str, dict[str, Any]] | None = None
    while True:
        kv = await admin_kv(router_url)
        snap = await asyncio.to_thread(checker.snapshot)
        seqs = {u: v["last_seq"] for u, v in snap.items()}
        if exact:
            same = all(r["kv_last_seq"] == seqs.get(r["url"]) for r in kv["backends"])
        else:
            same = prev is not None and seqs == {u: v["last_seq"] for u, v in prev.items()}
        if same or time.monotonic() > deadline:
            return kv, snap
        prev = snap
        await asyncio.sleep(0.5)


def view_check(kv: dict[str, Any], snap: dict[str, dict[str, Any]], exact: bool) -> dict:
    rows = {r["url"]: r for r in kv["backends"]}
    engine_blocks = sum(v["blocks"] or 0 for v in snap.values())
    out: dict[str, Any] = {"engine_blocks": engine_blocks}
    if exact:
        match = [
            rows[u]["confirmed_blocks"] == v["blocks"]
            and rows[u]["confirmed_digest"] == v["digest"]
            for u, v in snap.items()
        ]
        out["router_blocks"] = sum(r["confirmed_blocks"] or 0 for r in rows.values())
        out["backends_equal"] = f"{sum(match)}/{len(match)}"
        out["speculative_blocks"] = sum(r["speculative_blocks"] or 0 for r in rows.values())
    else:
        out["router_blocks"] = sum(r["index_blocks"] for r in rows.values())
        out["backends_equal"] = "n/a (text keys)"
    n = sum(r["num_reported"] for r in rows.values())
    out["pred_exact_share"] = sum(r["num_reported_exact"] for r in rows.values()) / n if n else None
    out["per_backend"] = {
        u: {
            "router": [
                rows[u]["confirmed_blocks"],
                rows[u]["confirmed_digest"],
                rows[u]["kv_last_seq"],
            ],
            "engine": [v["blocks"], v["digest"], v["last_seq"]],
        }
        for u, v in snap.items()
    }
    hit = sum(r["reported_hit_tokens"] for r in rows.values())
    pred = sum(r["reported_predicted_tokens"] for r in rows.values())
    out["predicted_over_reported"] = pred / hit if hit else None
    return out


async def one_run(args: argparse.Namespace, workload: str, mode: str, log_dir: Path) -> dict:
    n = args.backends
    http_base = free_port_range(n, 21000, 40000)
    kv_base = free_port_range(n, 40000, 60000)
    extra = ["--kv-events", "--kv-port-base", str(kv_base), "--kv-replay"]
    sim = ManagedProcess(
        "sim", sim_command(n, http_base, args.profile, args.speedup, extra), log_dir / "sim.log"
    )
    router: ManagedProcess | None = None
    checker: Checker | None = None
    try:
        await sim.start()
        engines = await sim_endpoints(sim, n)
        await sim.wait_ready([e.url + "/health" for e in engines], 60)
        checker = Checker(engines)
        checker.start()
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        router = ManagedProcess("router", router_cmd(mode, engines, port), log_dir / "router.log")
        await router.start()
        await router.wait_ready([router_url + "/health"], 60)
        if mode != "approximate":
            await wait_exact(router_url)
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
        kv, snap = await settled_views(router_url, checker, exact=mode != "approximate")
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
            **view_check(kv, snap, exact=mode != "approximate"),
        }
    finally:
        if checker is not None:
            checker.stop()
        for proc in (router, sim):
            if proc is not None:
                await proc.stop()


def compare_config(args: argparse.Namespace, workload: str) -> CompareConfig:
    overrides: dict[str, str] = {}
    load: dict[str, Any] = {"duration_s": args.duration}
    if workload.startswith("mooncake"):
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


def parse_args() -> argparse.Namespace:
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
    return p.parse_args()


async def main() -> int:
    args = parse_args()
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


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
