"""Kill a backend in the middle of a run and show what the clients saw.

Starts N single-backend simulators (one process each, so one can be SIGKILLed), a
``kvroute serve`` in front of them, and a closed-loop streaming workload. After
``--kill-after`` seconds one backend process is killed. At the end it prints how many
requests failed, split by whether they had started streaming (only those may fail:
everything else must be retried on another backend), and the router's in-flight load
per backend once the run is over (must be zero).

    .venv/bin/python scripts/kill_backend.py --backends 4 --duration 20 --kill-after 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.bench import default_load, make_workload, run_benchmark
from kvroute.bench.procs import ManagedProcess, free_port, free_port_range, sim_command


async def router_in_flight(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvroute_backend_in_flight_requests":
            for sample in family.samples:
                out[sample.labels["backend"]] = sample.value
    return out


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--policy", default="prefix")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--kill-after", type=float, default=8.0)
    args = ap.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="kvroute-kill-"))
    base = free_port_range(args.backends)
    sims = [
        ManagedProcess(f"sim{i}", sim_command(1, base + i, args.profile, 1.0), logs / f"sim{i}.log")
        for i in range(args.backends)
    ]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.backends)]
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "serve",
        "--policy",
        args.policy,
        "--port",
        str(port),
    ]
    for u in urls:
        cmd += ["--backend", u]
    router = ManagedProcess("router", cmd, logs / "router.log")
    procs = [*sims, router]
    try:
        for p in sims:
            await p.start()
        for p, u in zip(sims, urls, strict=True):
            await p.wait_ready([f"{u}/health"], 30)
        await router.start()
        await router.wait_ready([f"{router_url}/health"], 30)

        workload = make_workload(
            "gsp",
            seed=1,
            overrides={
                "num_groups": "6",
                "system_prompt_tokens": "600",
                "question_tokens": "40",
                "output_tokens": "120",
            },
        )
        load = default_load(
            workload,
            mode="closed",
            num_users=args.users,
            think_time_s=(0.0, 0.2),
            duration_s=args.duration,
            num_warmup=0,
            num_requests=None,
        )
        victim = sims[1]

        async def kill_later() -> None:
            await asyncio.sleep(args.kill_after)
            assert victim._proc is not None
            os.killpg(victim._proc.pid, signal.SIGKILL)
            print(f"killed {urls[1]} at t={args.kill_after:.0f} s", flush=True)

        killer = asyncio.create_task(kill_later())
        bench = await run_benchmark(
            router_url, workload, load, (), router=args.policy, target_is_backend=False
        )
        await killer
        await asyncio.sleep(1.0)
        records = [r for r in bench.records if not r.warmup]
        failed = [r for r in records if not r.ok]
        before = [r for r in failed if r.ttft_s is None]
        after = [r for r in failed if r.ttft_s is not None]
        retried = sum(1 for r in records if r.decision == "retry" and r.ok)
        print(
            f"requests: {len(records)}  ok: {len(records) - len(failed)}  retried-and-ok: {retried}"
        )
        print(f"failed before first token: {len(before)} (must be 0)")
        print(f"failed after streaming started (cut by the kill): {len(after)}")
        for r in after[:5]:
            print(f"  {r.request_id} on {r.backend}: {r.error}")
        in_flight = await router_in_flight(router_url)
        print("router in-flight requests per backend after the run:")
        for url, value in sorted(in_flight.items()):
            print(f"  {url}: {value:.0f}")
        return 0 if not before and not any(in_flight.values()) else 1
    finally:
        for p in reversed(procs):
            await p.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
