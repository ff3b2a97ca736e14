"""Router throughput and engine-measured hit rate with ``kvroute serve --workers N``.

Two measurements per worker count (default 1, 2, 4), each with fresh processes:

- throughput: ``kvroute sim --profile instant`` backends (answers cost ~nothing), the
  router with N workers in front, ``--clients`` load-generator processes with
  ``--concurrency`` connections in all sending short non-streaming completions for
  ``--duration`` seconds. Prints req/s, p50 latency and the router's CPU per request.
- hit rate: a fresh ``kvroute sim`` fleet of ``--hit-profile`` engines (speeded up),
  the router (prefix policy) with N workers, and ``kvroute bench --workload
  ranvier-stress --backend-metrics ...``; prints the engines' own prefix-cache hit rate
  (delta hits / delta queries, tokens), request throughput and mean TTFT. Rows with
  ``--no-worker-sync`` show the workers without decision sharing, and a round_robin
  row with 1 worker shows what placement without locality scores.

Each worker has its own index, fed by its own dispatches and (unless --no-worker-sync)
by its peers' (router/worker_sync.py). The numbers depend on the machine: client,
router and backends share its cores; ``--repeat`` interleaves repetitions.

    .venv/bin/python scripts/bench_workers.py [--workers 1,2,4] [--duration 8]
        [--hit-requests 300] [--skip-throughput] [--skip-hit-rate]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KVROUTE = [sys.executable, "-m", "kvroute.cli"]


@contextlib.contextmanager
def process(cmd: list[str]) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str]]]:
    """A subprocess whose stdout lines arrive on a queue; SIGTERM and wait on exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True).start()
    try:
        yield proc, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stdout.close()


def wait_line(lines: queue.Queue[str], pattern: str, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            line = lines.get(timeout=0.5)
            if re.search(pattern, line):
                return line
    raise RuntimeError(f"no line matching {pattern!r} within {timeout_s} s")


@contextlib.contextmanager
def sim_fleet(n: int, profile: str, speedup: float) -> Iterator[list[str]]:
    cmd = [*KVROUTE, "sim", "--backends", str(n), "--profile", profile,
           "--speedup", str(speedup), "--port-base", "0"]  # fmt: skip
    with process(cmd) as (_, lines):
        yield [wait_line(lines, rf"^backend {i}: ").split()[2] for i in range(n)]


@contextlib.contextmanager
def router(
    urls: list[str], workers: int, policy: str, sync: bool = True
) -> Iterator[tuple[str, int]]:
    """``kvroute serve --workers N``: (its URL, the supervisor pid)."""
    cmd = [*KVROUTE, "serve", "--workers", str(workers), "--port", "0", "--policy", policy]
    cmd += [] if sync else ["--no-worker-sync"]
    for url in urls:
        cmd += ["--backend", url]
    with process(cmd) as (proc, lines):
        line = wait_line(lines, r"listening on")
        yield re.search(r"http://\S+", line).group(0), proc.pid  # type: ignore[union-attr]


def cpu_seconds_tree(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (Linux /proc)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# ------------------------------------------------------------------ throughput


def _request_bytes(host: str, prompt: str) -> bytes:
    body = json.dumps({"model": "instant", "prompt": prompt, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The body after response headers ``head``: Content-Length or chunked."""
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if match:
        return await reader.readexactly(int(match.group(1)))
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")  # the empty trailer
    return body


async def _client(
    url: str, connections: int, duration_s: float, seed: int
) -> tuple[list[float], float]:
    """(latencies ms of 200 answers, elapsed s): ``connections`` keep-alive loops.

    A bare HTTP/1.1 client on asyncio streams (a few tens of microseconds per request),
    so that on a small machine the load generator takes less CPU than the router.
    """
    hostport = url.split("//", 1)[1]
    host, port = hostport.rsplit(":", 1)
    requests = [
        _request_bytes(hostport, f"Conversation {k}: the quick brown fox jumps. " * 4)
        for k in range(64)
    ]
    lat: list[float] = []
    t0 = time.perf_counter()
    stop_at = t0 + duration_s

    async def loop(k: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        i = seed * 31 + k
        try:
            while (t := time.perf_counter()) < stop_at:
                writer.write(requests[i % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                await _read_body(reader, head)
                if head.startswith(b"HTTP/1.1 200"):
                    lat.append((time.perf_counter() - t) * 1000)
                i += 7
        finally:
            writer.close()

    await asyncio.gather(*(loop(k) for k in range(connections)))
    return lat, time.perf_counter() - t0


def _client_process(url: str, connections: int, duration_s: float, seed: int, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_client(url, connections, duration_s, seed)))


def measure_throughput(
    url: str, router_pid: int, clients: int, concurrency: int, duration_s: float
) -> tuple[float, float, float]:
    """(req/s, p50 ms, router CPU us per request) with ``clients`` load processes."""
    ctx = multiprocessing.get_context("spawn")
    asyncio.run(_client(url, 8, 1.0, 99))  # warm-up: pools, first-use imports
    out = ctx.Queue()
    per = max(1, concurrency // clients)
    procs = [
        ctx.Process(target=_client_process, args=(url, per, duration_s, c, out))
        for c in range(clients)
    ]
    cpu0 = cpu_seconds_tree(router_pid)
    for p in procs:
        p.start()
    lat: list[float] = []
    rps = 0.0
    for _ in procs:
        client_lat, elapsed_s = out.get(timeout=duration_s + 60)
        lat += client_lat
        rps += len(client_lat) / elapsed_s  # the clients run side by side
    cpu1 = cpu_seconds_tree(router_pid)
    for p in procs:
        p.join()
    return rps, statistics.median(lat), (cpu1 - cpu0) / max(1, len(lat)) * 1e6


# ------------------------------------------------------------------ hit rate


def measure_hit_rate(
    args: argparse.Namespace, workers: int, policy: str, sync: bool
) -> dict[str, float]:
    with (
        sim_fleet(args.backends, args.hit_profile, args.speedup) as urls,
        router(urls, workers, policy, sync) as (url, _),
        tempfile.TemporaryDirectory() as out,
    ):
        cmd = [*KVROUTE, "bench", "--target", url, "--workload", "ranvier-stress",
               "--concurrency", str(args.hit_concurrency), "--think-time", args.think_time,
               "--num-requests", str(args.hit_requests), "--num-warmup", "0",
               "--seed", str(args.seed), "--backend-metrics", *urls, "--out", out,
               "--no-plots", "--quiet", "--router", f"{policy}x{workers}"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads((Path(out) / "result.json").read_text())
    return {
        "hit": result["engine_prefix_hit_rate"],
        "rps": result["request_throughput"],
        "ttft": result["mean_ttft_ms"],
        "failed": result["failed"],
        "completed": result["completed"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4", help="worker counts to compare")
    p.add_argument("--backends", type=int, default=4, help="simulated engines")
    p.add_argument("--policy", default="prefix", help="router policy (default prefix)")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--concurrency", type=int, default=128, help="connections in all")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per throughput run")
    p.add_argument("--hit-profile", default="codellama-13b-a100-40g", help="engine profile")
    p.add_argument("--speedup", type=float, default=20.0, help="engine time speedup")
    p.add_argument("--hit-requests", type=int, default=300, help="requests per hit-rate run")
    p.add_argument("--hit-concurrency", type=int, default=30, help="ranvier-stress users")
    p.add_argument("--think-time", default="0.1,0.4", help="users' think time A,B s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-hit-rate", action="store_true")
    p.add_argument("--skip-no-sync", action="store_true", help="no --no-worker-sync rows")
    p.add_argument("--repeat", type=int, default=1, help="run each configuration this often")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the sims and routers started here are stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    counts = [int(x) for x in args.workers.split(",")]
    print(f"{os.cpu_count()} CPUs shared by clients, router workers and backends")
    if not args.skip_throughput:
        print(f"\nthroughput: {args.backends} instant backends, policy {args.policy}, "
              f"{args.clients} client processes x {args.concurrency // args.clients} "
              f"connections, {args.duration:g} s, max_tokens 1, non-streaming")  # fmt: skip
        print(f"{'workers':>7} {'sync':>5} {'req/s':>9} {'p50 ms':>8} {'router CPU us/req':>18}")
        rows = [(n, True) for n in counts]
        rows += [(n, False) for n in counts if n > 1 and not args.skip_no_sync]
        with sim_fleet(args.backends, "instant", 1.0) as urls:
            for _ in range(args.repeat):
                for n, sync in rows:
                    with router(urls, n, args.policy, sync) as (url, pid):
                        rps, p50, cpu = measure_throughput(
                            url, pid, args.clients, args.concurrency, args.duration
                        )
                    sync_text = "yes" if sync else "no"
                    print(f"{n:>7} {sync_text:>5} {rps:9.0f} {p50:8.2f} {cpu:18.0f}", flush=True)
    if not args.skip_hit_rate:
        print(f"\nhit rate: ranvier-stress, {args.backends} x {args.hit_profile} (speedup "
              f"{args.speedup:g}), {args.hit_requests} requests, {args.hit_concurrency} users, "
              f"think {args.think_time} s, seed {args.seed}; engine-measured (tokens)")  # fmt: skip
        print(f"{'policy':>12} {'workers':>7} {'sync':>5} {'hit %':>7} {'req/s':>7} "
              f"{'mean TTFT ms':>13} {'failed':>6}")  # fmt: skip
        rows = [(args.policy, n, True) for n in counts]
        rows += [(args.policy, n, False) for n in counts if n > 1 and not args.skip_no_sync]
        rows += [("round_robin", 1, True)]
        for _ in range(args.repeat):
            for policy, n, sync in rows:
                r = measure_hit_rate(args, n, policy, sync)
                hit_pct, sync_text = 100 * r["hit"], "yes" if sync else "no"
                print(f"{policy:>12} {n:>7} {sync_text:>5} {hit_pct:7.1f} {r['rps']:7.2f} "
                      f"{r['ttft']:13.0f} {r['failed']:>6}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
