"""Router overhead: the same requests direct to an instant backend and through the router.

Starts an instant backend (the simulator's ``instant`` profile, or ``--minimal``: the
canned backend of ``kvroute.bench.fake_backend``) and ``kvroute serve`` in separate
processes, then measures from this process with an aiohttp client:

- sequential latency (one request at a time): p50 / p99, direct vs through the router;
- throughput: ``--concurrency`` workers for ``--duration`` seconds, req/s and p50.

Prints one table. Numbers depend on the machine (the client, router and backend share
its cores); compare the rows with each other, not with other machines.

    python -m kvroute.bench.perf.overhead [--minimal] [--requests 2000]

(``scripts/bench_overhead.py`` runs the same.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from kvroute.bench.perf.clients import concurrent, percentile, sequential
from kvroute.bench.procs import KVROUTE, ManagedProcess, cpu_seconds, free_port


async def run(args: argparse.Namespace, logs: Path) -> None:
    backend_port, router_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    if args.minimal:
        backend_cmd = [sys.executable, "-m", "kvroute.bench.fake_backend", str(backend_port)]
        model = "m"
    else:
        backend_cmd = [*KVROUTE, "sim", "--backends", "1", "--profile", "instant",
                       "--port-base", str(backend_port)]  # fmt: skip
        model = "instant"
    router_cmd = [*KVROUTE, "serve", "--backend", backend_url, "--policy", args.policy,
                  "--port", str(router_port)]  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog. " * args.prompt_repeat
    body = (
        f'{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 1, "stream": false}}'
    ).encode()
    bproc = ManagedProcess("backend", backend_cmd, logs / "backend.log")
    rproc = ManagedProcess("router", router_cmd, logs / "router.log")
    async with contextlib.AsyncExitStack() as stack:
        for proc, url in ((bproc, backend_url), (rproc, router_url)):
            await proc.start()
            stack.push_async_callback(proc.stop)
            await proc.wait_ready([url + "/health"], 30)
        assert bproc.pid is not None and rproc.pid is not None
        rows = []
        for name, url in (("direct", backend_url), ("router", router_url)):
            seq = await sequential(url, body, args.requests)
            cpu0 = cpu_seconds(rproc.pid), cpu_seconds(bproc.pid)
            rps, p50c = await concurrent(url, body, args.concurrency, args.duration)
            cpu1 = cpu_seconds(rproc.pid), cpu_seconds(bproc.pid)
            n = rps * args.duration
            cpu_us = [(b - a) / n * 1e6 for a, b in zip(cpu0, cpu1, strict=True)]
            rows.append((name, percentile(seq, 0.5), percentile(seq, 0.99), rps, p50c, *cpu_us))
    kind = "minimal aiohttp" if args.minimal else "sim instant"
    print(f"backend: {kind}; policy {args.policy}; prompt {len(prompt)} chars; "
          f"{args.requests} sequential, {args.concurrency} workers x {args.duration:g} s; "
          f"{os.cpu_count()} CPUs shared by client, router and backend")  # fmt: skip
    print(f"{'path':8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>9} {'p50 ms @C':>10} "
          f"{'router CPU us/req':>18} {'backend CPU us/req':>19}")  # fmt: skip
    for name, p50, p99, rps, p50c, r_cpu, b_cpu in rows:
        print(f"{name:8} {p50:8.3f} {p99:8.3f} {rps:9.0f} {p50c:10.2f} {r_cpu:18.0f} {b_cpu:19.0f}")
    d, r = rows
    print(f"added latency p50 {r[1] - d[1]:.3f} ms, p99 {r[2] - d[2]:.3f} ms; "
          f"router throughput {r[3]:.0f} req/s ({100 * r[3] / d[3]:.0f} % of direct); "
          f"router CPU {r[5]:.0f} us/req (<= {1e6 / r[5]:.0f} req/s on a free core)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minimal", action="store_true", help="canned backend, not the sim")
    p.add_argument("--policy", default="round_robin", help="router policy (default round_robin)")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=32, help="workers in the throughput run")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of the throughput run")
    p.add_argument("--prompt-repeat", type=int, default=8, help="prompt = sentence x this")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvroute-overhead-") as folder:
        asyncio.run(run(args, Path(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
