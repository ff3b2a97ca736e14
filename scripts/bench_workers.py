"""Router throughput and engine-measured hit rate with ``kvroute serve --workers N``.

Two measurements per worker count (default 1, 2, 4), each with fresh router processes:

- throughput: ``--backends`` bare HTTP backends that answer a completion for almost no
  CPU (``--throughput-backend minimal``, the one of bench_overhead.py; or ``instant``:
  ``kvroute sim --profile instant``, which costs about as much CPU per request as the
  router), the router with N workers in front, and wrk (C, one thread; or, without wrk,
  ``--clients`` Python client processes) with ``--concurrency`` keep-alive connections
  sending non-streaming requests with ``max_tokens`` 1 for ``--duration`` seconds: the
  first 256 requests of ``--throughput-workload`` (default ranvier-stress, the hit-rate
  workload: chat, 3,400 prompt tokens on average), or 64 short completions ("short").
  The worker counts are interleaved ``--repeat`` times (the machine is shared and noisy)
  and the summary gives the median req/s per count and its ratio to 1 worker.
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

    .venv/bin/python scripts/bench_workers.py [--workers 1,2,4] [--duration 8]
        [--repeat 3] [--hit-requests 300] [--hit-mode exact] [--skip-throughput]
        [--skip-hit-rate]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import MINIMAL_BACKEND

from kvroute.bench.procs import free_port, free_port_range, sim_command
from kvroute.bench.workloads import make_workload

KVROUTE = [sys.executable, "-m", "kvroute.cli"]
PROMPTS = [f"Conversation {k}: the quick brown fox jumps. " * 4 for k in range(64)]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def request_bodies(workload: str, model: str, count: int = 256) -> list[tuple[str, bytes]]:
    """(path, JSON body) of the throughput runs: ``count`` requests of ``workload``, or 64
    short completions ("short"); non-streaming, max_tokens 1."""
    if workload == "short":
        return [
            ("/v1/completions", json.dumps({"model": model, "prompt": p, "max_tokens": 1}).encode())
            for p in PROMPTS
        ]
    out = []
    for spec in itertools.islice(make_workload(workload, seed=0).requests(), count):
        body = spec.body(model, stream=False)
        body["max_tokens"] = 1
        out.append((PATHS[spec.endpoint], json.dumps(body).encode()))
    return out


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
def sim_fleet(
    n: int, profile: str, speedup: float, kv_events: bool = False
) -> Iterator[tuple[list[str], list[str]]]:
    """``kvroute sim``: (backend URLs, their KV-event endpoints or [])."""
    kv = ["--kv-events", "--kv-port-base", str(free_port_range(n))] if kv_events else []
    with process(sim_command(n, 0, profile, speedup, kv)) as (_, lines):
        found = [wait_line(lines, rf"^backend {i}: ").split() for i in range(n)]
        urls = [words[2] for words in found]
        yield urls, [words[4] for words in found] if kv_events else []


@contextlib.contextmanager
def minimal_fleet(n: int) -> Iterator[list[str]]:
    """``n`` bare aiohttp backends (bench_overhead.py's): a canned completion, no engine."""
    ports = [free_port() for _ in range(n)]
    with contextlib.ExitStack() as stack:
        for port in ports:
            stack.enter_context(process([sys.executable, "-c", MINIMAL_BACKEND, str(port)]))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_http(url + "/health")
        yield urls


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


@contextlib.contextmanager
def router(
    urls: list[str],
    workers: int,
    policy: str,
    sync: bool = True,
    kv: list[str] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """``kvroute serve --workers N`` (exact mode when ``kv`` endpoints are given; ``extra``:
    more flags)."""
    cmd = [*KVROUTE, "serve", "--workers", str(workers), "--port", "0", "--policy", policy,
           "--log-level", "WARNING", *extra]  # fmt: skip
    cmd += [] if sync else ["--no-worker-sync"]
    for url in urls:
        cmd += ["--backend", url]
    if kv:
        cmd += ["--mode", "exact"]
        for url, endpoint in zip(urls, kv, strict=True):
            cmd += ["--kv-events", f"{url}={endpoint}"]
    with process(cmd) as (proc, lines):
        line = wait_line(lines, r"listening on")
        url = re.search(r"http://\S+", line).group(0)  # type: ignore[union-attr]
        wait_http(url + "/health")
        yield url, proc.pid


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


def _request_bytes(host: str, path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
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
    url: str, connections: int, duration_s: float, seed: int, bodies: list[tuple[str, bytes]]
) -> tuple[list[float], float]:
    """(latencies ms of 200 answers, elapsed s): ``connections`` keep-alive loops.

    A bare HTTP/1.1 client on asyncio streams (a few tens of microseconds per request),
    so that on a small machine the load generator takes less CPU than the router.
    """
    hostport = url.split("//", 1)[1]
    host, port = hostport.rsplit(":", 1)
    requests = [_request_bytes(hostport, path, body) for path, body in bodies]
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


def _client_process(
    url: str, connections: int, duration_s: float, seed: int, bodies: list[Any], out: Any
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_client(url, connections, duration_s, seed, bodies)))


def measure_throughput(
    url: str, router_pid: int, args: argparse.Namespace, bodies: list[tuple[str, bytes]]
) -> tuple[float, float, float]:
    """(req/s, p50 ms, router CPU us per request): wrk if installed, else Python clients."""
    asyncio.run(_client(url, 8, 1.0, 99, bodies))  # warm-up: pools, first-use imports
    cpu0 = cpu_seconds_tree(router_pid)
    if args.client == "wrk":
        rps, p50, count = _wrk(url, args.concurrency, args.duration, bodies)
    else:
        rps, p50, count = _python_clients(url, args, bodies)
    cpu1 = cpu_seconds_tree(router_pid)
    return rps, p50, (cpu1 - cpu0) / max(1, count) * 1e6


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
paths = {%s}
bodies = {%s}
i = 0
request = function()
  i = i + 1
  local k = (i %% #bodies) + 1
  return wrk.format(nil, paths[k], nil, bodies[k])
end
done = function(summary, latency, requests)
  io.write(string.format("KVROUTE %%d %%d %%f\\n", summary.requests,
    summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout, latency:percentile(50) / 1000))
end
"""


def _wrk(
    url: str, connections: int, duration_s: float, bodies: list[tuple[str, bytes]]
) -> tuple[float, float, int]:
    paths = ",".join(f'"{path}"' for path, _ in bodies)
    texts = ",".join(_lua_long_string(body.decode()) for _, body in bodies)
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT % (paths, texts))
        script.flush()
        cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "-s", script.name, url]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    total, errors, p50 = re.search(r"KVROUTE (\d+) (\d+) ([\d.]+)", out).groups()  # type: ignore[union-attr]
    ok = int(total) - int(errors)
    if int(errors):
        print(f"  ({errors} failed requests through {url})", file=sys.stderr)
    return ok / duration_s, float(p50), ok


def _lua_long_string(text: str) -> str:
    """``text`` as a Lua long string literal ([==[ ... ]==] with a level it does not contain)."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def _python_clients(
    url: str, args: argparse.Namespace, bodies: list[tuple[str, bytes]]
) -> tuple[float, float, int]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per = max(1, args.concurrency // args.clients)
    procs = [
        ctx.Process(target=_client_process, args=(url, per, args.duration, c, bodies, out))
        for c in range(args.clients)
    ]
    for p in procs:
        p.start()
    lat: list[float] = []
    rps = 0.0
    for _ in procs:
        client_lat, elapsed_s = out.get(timeout=args.duration + 60)
        lat += client_lat
        rps += len(client_lat) / elapsed_s  # the clients run side by side
    for p in procs:
        p.join()
    return rps, statistics.median(lat), len(lat)


@contextlib.contextmanager
def throughput_fleet(args: argparse.Namespace) -> Iterator[tuple[list[str], str]]:
    """(backend URLs, the model they serve) for the throughput runs."""
    if args.throughput_backend == "minimal":
        with minimal_fleet(args.backends) as urls:
            yield urls, "m"
    else:
        with sim_fleet(args.backends, "instant", 1.0) as (urls, _):
            yield urls, "instant"


def run_throughput(args: argparse.Namespace, counts: list[int]) -> None:
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
    with throughput_fleet(args) as (urls, model):
        bodies = request_bodies(args.throughput_workload, model)
        for k in range(args.repeat):
            for n, sync in rows:
                with router(urls, n, args.policy, sync) as (url, pid):
                    rps, p50, cpu = measure_throughput(url, pid, args, bodies)
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
    args: argparse.Namespace, workers: int, policy: str, sync: bool
) -> dict[str, float]:
    exact = args.hit_mode == "exact" and policy != "round_robin"
    with (
        sim_fleet(args.backends, args.hit_profile, args.speedup, exact) as (urls, kv),
        router(urls, workers, policy, sync, kv) as (url, _),
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


def run_hit_rate(args: argparse.Namespace, counts: list[int]) -> None:
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
            r = measure_hit_rate(args, n, policy, sync)
            hit_pct, sync_text = 100 * r["hit"], "yes" if sync else "no"
            print(f"{policy:>12} {n:>7} {sync_text:>5} {hit_pct:7.1f} {r['rps']:7.2f} "
                  f"{r['ttft']:13.0f} {r['failed']:>6}", flush=True)  # fmt: skip


def main() -> None:
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
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the processes started here are stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    counts = [int(x) for x in args.workers.split(",")]
    print(f"{os.cpu_count()} CPUs shared by clients, router workers and backends; "
          f"load average {os.getloadavg()[0]:.2f} at the start")  # fmt: skip
    if not args.skip_throughput:
        run_throughput(args, counts)
    if not args.skip_hit_rate:
        run_hit_rate(args, counts)


if __name__ == "__main__":
    main()
