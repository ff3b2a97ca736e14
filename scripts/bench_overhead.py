"""Router overhead: the same requests direct to an instant backend and through the router.

Starts an instant backend (the simulator's ``instant`` profile, or ``--minimal``: a bare
aiohttp app answering a fixed completion) and ``kvroute serve`` in separate processes,
then measures from this process with an aiohttp client:

- sequential latency (one request at a time): p50 / p99, direct vs through the router;
- throughput: ``--concurrency`` workers for ``--duration`` seconds, req/s and p50.

Prints one table. Numbers depend on the machine (the client, router and backend share
its cores); compare the rows with each other, not with other machines.

    .venv/bin/python scripts/bench_overhead.py [--minimal] [--requests 2000] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp

MINIMAL_BACKEND = """
import sys
from aiohttp import web
BODY = (b'{"id":"cmpl-1","object":"text_completion","created":0,"model":"m",'
        b'"choices":[{"index":0,"text":" ok","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
CHAT = (b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"m",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
        b'"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
async def completions(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
async def chat(request):
    await request.read()
    return web.Response(body=CHAT, content_type="application/json")
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
async def health(request):
    return web.Response()
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", health)
try:
    import uvloop; uvloop.install()
except ImportError:
    pass
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(cmd: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"process exited early: {err[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(url: str, body: bytes, n: int) -> list[float]:
    """Latency in ms of ``n`` requests sent one after another on one keep-alive connection."""
    out = []
    conn = aiohttp.TCPConnector(limit=1)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn) as s:
        for i in range(n + 50):
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: status {r.status}")
            if i >= 50:  # warm-up excluded
                out.append((time.perf_counter() - t) * 1000)
    return out


async def concurrent(url: str, body: bytes, workers: int, duration_s: float) -> tuple[float, float]:
    """(req/s, p50 ms) with ``workers`` clients looping for ``duration_s`` seconds."""
    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration_s
    headers = {"Content-Type": "application/json"}

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            lat.append((time.perf_counter() - t) * 1000)

    conn = aiohttp.TCPConnector(limit=workers)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(workers)))
        elapsed = time.perf_counter() - t0
    if errors:
        print(f"  ({errors} non-200 answers from {url})", file=sys.stderr)
    return len(lat) / elapsed, statistics.median(lat)


async def run(args: argparse.Namespace) -> None:
    backend_port, router_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    py = sys.executable
    if args.minimal:
        backend_cmd = [py, "-c", MINIMAL_BACKEND, str(backend_port)]
        model = "m"
    else:
        backend_cmd = [py, "-m", "kvroute.cli", "sim", "--backends", "1", "--profile",
                       "instant", "--port-base", str(backend_port)]  # fmt: skip
        model = "instant"
    router_cmd = [py, "-m", "kvroute.cli", "serve", "--backend", backend_url, "--policy",
                  args.policy, "--port", str(router_port)]  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog. " * args.prompt_repeat
    body = (
        f'{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 1, "stream": false}}'
    ).encode()
    with process(backend_cmd) as bproc:
        await wait_ready(backend_url, bproc)
        with process(router_cmd) as rproc:
            await wait_ready(router_url, rproc)
            rows = []
            for name, url in (("direct", backend_url), ("router", router_url)):
                seq = await sequential(url, body, args.requests)
                cpu0 = cpu_seconds(rproc.pid), cpu_seconds(bproc.pid)
                rps, p50c = await concurrent(url, body, args.concurrency, args.duration)
                cpu1 = cpu_seconds(rproc.pid), cpu_seconds(bproc.pid)
                n = rps * args.duration
                cpu_us = [(b - a) / n * 1e6 for a, b in zip(cpu0, cpu1, strict=True)]
                rows.append((name, _pct(seq, 0.5), _pct(seq, 0.99), rps, p50c, *cpu_us))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minimal", action="store_true", help="bare aiohttp backend, not the sim")
    p.add_argument("--policy", default="round_robin", help="router policy (default round_robin)")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=32, help="workers in the throughput run")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of the throughput run")
    p.add_argument("--prompt-repeat", type=int, default=8, help="prompt = sentence x this")
    p.add_argument(
        "--print-minimal-backend", action="store_true", help="print the bare backend and exit"
    )
    args = p.parse_args()
    if args.print_minimal_backend:
        print(MINIMAL_BACKEND)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
