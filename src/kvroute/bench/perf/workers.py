"""Router throughput and engine-measured hit rate with ``kvroute serve --workers N``.

Two measurements per worker count (default 1, 2, 4), each with fresh router processes:

- throughput: ``--backends`` bare HTTP backends that answer a completion for almost no
  CPU (``--throughput-backend minimal``: ``python -m kvroute.bench.fake_backend``; or
  ``instant``: ``kvroute sim --profile instant``, which costs about as much CPU per
  request as the router), the router with N workers in front, and wrk (C, one thread;
  or, without wrk, ``--clients`` Python client processes) with ``--concurrency``
  keep-alive connections sending non-streaming requests with ``max_tokens`` 1 for
  ``--duration`` seconds: the first 256 requests of ``--throughput-workload`` (default
  ranvier-stress, the hit-rate workload: chat, 3,400 prompt tokens on average), or 64
  short completions ("short"). The worker counts are interleaved ``--repeat`` times (the
  machine is shared and noisy) and the summary gives the median req/s per count and its
  ratio to 1 worker.
- hit rate: a fresh ``kvroute sim`` fleet of ``--hit-profile`` engines (speeded up),
  the router (prefix policy) with N workers, and ``kvroute bench --workload
  ranvier-stress --backend-metrics ...``; prints the engines' own prefix-cache hit rate
  over the measured requests, after ``--hit-warmup`` ones (delta hits / delta queries,
  tokens), request throughput and mean TTFT. ``--hit-mode exact`` makes the fleet
  publish KV events and every worker subscribe to them. Rows with ``--no-worker-sync``
  show the workers without decision sharing, and a round_robin row with 1 worker shows
  what placement without locality scores.

Each worker has its own index, fed by its own dispatches and (unless --no-worker-sync)
by its peers' (router/worker_sync.py), and in exact mode by the engines' events. The
numbers depend on the machine: client, router workers and backends share its cores.

    python -m kvroute.bench.perf.workers [--workers 1,2,4] [--duration 8] [--repeat 3]
        [--hit-requests 300] [--hit-mode exact] [--skip-throughput] [--skip-hit-rate]

(``scripts/bench_workers.py`` runs the same.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvroute.bench.perf.clients import measure_throughput, request_bodies
from kvroute.bench.procs import (
    KVROUTE,
    SIM_LINE,
    ManagedProcess,
    exit_on_sigterm,
    free_port,
    free_port_range,
    sim_command,
    sim_engines,
)


@contextlib.contextmanager
def child(name: str, cmd: Sequence[str], logs: Path) -> Iterator[ManagedProcess]:
    """``cmd`` running, its output in ``logs/<name>.log``; stopped on the way out."""
    proc = ManagedProcess(name, cmd, logs / f"{name}.log")
    proc.launch()
    try:
        yield proc
    finally:
        proc.stop_sync(grace_s=40)  # a router drains its workers first


@contextlib.contextmanager
def sim_fleet(
    n: int, profile: str, speedup: float, logs: Path, kv_events: bool = False
) -> Iterator[tuple[list[str], list[str]]]:
    """``kvroute sim``: (backend URLs, their KV-event endpoints or [])."""
    kv = ["--kv-events", "--kv-port-base", str(free_port_range(n))] if kv_events else []
    with child("sim", sim_command(n, 0, profile, speedup, kv), logs) as proc:
        engines = sim_engines(proc.wait_line_sync(SIM_LINE, 90, count=n))
        yield [e.url for e in engines], [e.kv_events or "" for e in engines if kv_events]


@contextlib.contextmanager
def minimal_fleet(n: int, logs: Path) -> Iterator[list[str]]:
    """``n`` canned backends (``kvroute.bench.fake_backend``; model "m"), no engine."""
    ports = [free_port() for _ in range(n)]
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "kvroute.bench.fake_backend", str(port)]
            proc = stack.enter_context(child(f"backend{i}", cmd, logs))
            proc.wait_ready_sync([f"http://127.0.0.1:{port}/health"], 30)
        yield [f"http://127.0.0.1:{port}" for port in ports]


@contextlib.contextmanager
def router(
    urls: list[str],
    workers: int,
    policy: str,
    logs: Path,
    sync: bool = True,
    kv: list[str] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """``kvroute serve --workers N`` (exact mode when ``kv`` endpoints are given; ``extra``:
    more flags): (its URL, its pid)."""
    cmd = [*KVROUTE, "serve", "--workers", str(workers), "--port", "0", "--policy", policy,
           "--log-level", "WARNING", *extra]  # fmt: skip
    cmd += [] if sync else ["--no-worker-sync"]
    for url in urls:
        cmd += ["--backend", url]
    if kv:
        cmd += ["--mode", "exact"]
        for url, endpoint in zip(urls, kv, strict=True):
            cmd += ["--kv-events", f"{url}={endpoint}"]
    with child("router", cmd, logs) as proc:
        (line,) = proc.wait_line_sync(r"listening on http://", 90)
        url = re.search(r"http://\S+", line).group(0)  # type: ignore[union-attr]
        proc.wait_ready_sync([url + "/health"], 30)
        assert proc.pid is not None
        yield url, proc.pid


# ------------------------------------------------------------------ throughput


@contextlib.contextmanager
def throughput_fleet(args: argparse.Namespace, logs: Path) -> Iterator[tuple[list[str], str]]:
    """(backend URLs, the model they serve) for the throughput runs."""
    if args.throughput_backend == "minimal":
        with minimal_fleet(args.backends, logs) as urls:
            yield urls, "m"
    else:
        with sim_fleet(args.backends, "instant", 1.0, logs) as (urls, _):
            yield urls, "instant"


def run_throughput(args: argparse.Namespace, counts: list[int], logs: Path) -> None:
    client = (f"wrk -t1 -c{args.concurrency}" if args.client == "wrk" else
              f"{args.clients} Python client processes x {args.concurrency // args.clients}"
              " connections")  # fmt: skip
    print(f"\nthroughput: {args.backends} {args.throughput_backend} backends, policy "
          f"{args.policy}, {client}, {args.throughput_workload} requests with max_tokens 1, "
          f"{args.duration:g} s per row, "
          f"non-streaming, {args.repeat} interleaved rounds")  # fmt: skip
    print(f"{'round':>5} {'workers':>7} {'sync':>5} {'req/s':>9} {'p50 ms':>8} "
          f"{'router CPU us/req':>18}")  # fmt: skip
    rows = [(n, True) for n in counts]
    rows += [(n, False) for n in counts if n > 1 and not args.skip_no_sync]
    results: dict[tuple[int, bool], list[float]] = {row: [] for row in rows}
    with throughput_fleet(args, logs) as (urls, model):
        bodies = request_bodies(args.throughput_workload, model)
        for k in range(args.repeat):
            for n, sync in rows:
                with router(urls, n, args.policy, logs, sync) as (url, pid):
                    rps, p50, cpu = measure_throughput(
                        url, pid, bodies, client=args.client, connections=args.concurrency,
                        duration_s=args.duration, processes=args.clients,
                    )  # fmt: skip
                results[n, sync].append(rps)
                sync_text = "yes" if sync else "no"
                print(f"{k + 1:>5} {n:>7} {sync_text:>5} {rps:9.0f} {p50:8.2f} {cpu:18.0f}",
                      flush=True)  # fmt: skip
    base = statistics.median(results[rows[0]])
    print("median req/s: " + ", ".join(
        f"{n} worker{'s' if n > 1 else ''}{'' if sync else ' (no sync)'} "
        f"{statistics.median(v):.0f} (x{statistics.median(v) / base:.2f})"
        for (n, sync), v in results.items()
    ))  # fmt: skip


# ------------------------------------------------------------------ hit rate


def measure_hit_rate(
    args: argparse.Namespace, workers: int, policy: str, sync: bool, logs: Path
) -> dict[str, float]:
    exact = args.hit_mode == "exact" and policy != "round_robin"
    with (
        sim_fleet(args.backends, args.hit_profile, args.speedup, logs, exact) as (urls, kv),
        router(urls, workers, policy, logs, sync, kv) as (url, _),
        tempfile.TemporaryDirectory() as out,
    ):
        cmd = [*KVROUTE, "bench", "--target", url, "--workload", "ranvier-stress",
               "--concurrency", str(args.hit_concurrency), "--think-time", args.think_time,
               "--num-requests", str(args.hit_requests), "--num-warmup", str(args.hit_warmup),
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


def run_hit_rate(args: argparse.Namespace, counts: list[int], logs: Path) -> None:
    print(f"\nhit rate: ranvier-stress, {args.backends} x {args.hit_profile} (speedup "
          f"{args.speedup:g}), {args.hit_mode} mode, {args.hit_warmup} warm-up + "
          f"{args.hit_requests} measured requests, "
          f"{args.hit_concurrency} users, think {args.think_time} s, seed {args.seed}; "
          "engine-measured (tokens)")  # fmt: skip
    print(f"{'policy':>12} {'workers':>7} {'sync':>5} {'hit %':>7} {'req/s':>7} "
          f"{'mean TTFT ms':>13} {'failed':>6}")  # fmt: skip
    rows = [(args.policy, n, True) for n in counts]
    rows += [(args.policy, n, False) for n in counts if n > 1 and not args.skip_no_sync]
    rows += [("round_robin", 1, True)]
    for _ in range(args.repeat):
        for policy, n, sync in rows:
            r = measure_hit_rate(args, n, policy, sync, logs)
            hit_pct, sync_text = 100 * r["hit"], "yes" if sync else "no"
            print(f"{policy:>12} {n:>7} {sync_text:>5} {hit_pct:7.1f} {r['rps']:7.2f} "
                  f"{r['ttft']:13.0f} {r['failed']:>6}", flush=True)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4", help="worker counts to compare")
    p.add_argument("--backends", type=int, default=8, help="backends (default 8)")
    p.add_argument("--policy", default="prefix", help="router policy (default prefix)")
    p.add_argument("--throughput-backend", choices=("minimal", "instant"), default="minimal")
    p.add_argument("--throughput-workload", default="ranvier-stress",
                   help='send its requests (or "short": 64 short prompts)')  # fmt: skip
    p.add_argument("--client", choices=("wrk", "python"),
                   default="wrk" if shutil.which("wrk") else "python",
                   help="load generator (default wrk when installed)")  # fmt: skip
    p.add_argument("--clients", type=int, default=2, help="Python client processes")
    p.add_argument("--concurrency", type=int, default=64, help="connections in all")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per throughput run")
    p.add_argument("--hit-profile", default="codellama-13b-a100-40g", help="engine profile")
    p.add_argument("--hit-mode", choices=("approximate", "exact"), default="approximate")
    p.add_argument("--speedup", type=float, default=20.0, help="engine time speedup")
    p.add_argument("--hit-requests", type=int, default=300, help="requests per hit-rate run")
    p.add_argument("--hit-warmup", type=int, default=60,
                   help="requests before the measured ones (the engines warm up)")  # fmt: skip
    p.add_argument("--hit-concurrency", type=int, default=30, help="ranvier-stress users")
    p.add_argument("--think-time", default="0.1,0.4", help="users' think time A,B s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-hit-rate", action="store_true")
    p.add_argument("--skip-no-sync", action="store_true", help="no --no-worker-sync rows")
    p.add_argument("--repeat", type=int, default=3, help="rounds of each configuration")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds like Ctrl-C, so the processes started here stop
    counts = [int(x) for x in args.workers.split(",")]
    print(f"{os.cpu_count()} CPUs shared by clients, router workers and backends; "
          f"load average {os.getloadavg()[0]:.2f} at the start")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvroute-workers-") as folder:
        if not args.skip_throughput:
            run_throughput(args, counts, Path(folder))
        if not args.skip_hit_rate:
            run_hit_rate(args, counts, Path(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
