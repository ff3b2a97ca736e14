"""Load generators for the router-cost runs: a bare HTTP/1.1 client and wrk.

The load generator shares the machine's cores with the router and the backends, so it
must cost less than the router: ``raw_client`` is a keep-alive loop on asyncio streams
(a few tens of microseconds per request), ``wrk`` a C client (one thread), and
``python_clients`` spreads ``raw_client`` over processes when wrk is not installed.
``sequential`` and ``concurrent`` (aiohttp) measure latency rather than capacity.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.bench.procs import cpu_seconds
from kvroute.bench.workloads import make_workload

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
SHORT_PROMPTS = [f"Conversation {k}: the quick brown fox jumps. " * 4 for k in range(64)]

Bodies = list[tuple[str, bytes]]  # (path, JSON body) of each request, sent in turn


# wrk replaces it in each request with the request's number (see WRK_SCRIPT)
UNIQUE_MARK = "@@N@@"


def request_bodies(workload: str, model: str, count: int = 256, unique: bool = False) -> Bodies:
    """``count`` requests of ``workload``, or 64 short completions ("short");
    non-streaming, max_tokens 1. ``unique``: the last message (or the prompt) ends with
    a number wrk makes different in every request, as a user's new turn would be, so
    nothing after the shared prefix repeats (the Python clients send it as it is)."""
    if workload == "short":
        return [
            ("/v1/completions", json.dumps({"model": model, "prompt": p, "max_tokens": 1}).encode())
            for p in SHORT_PROMPTS
        ]
    out = []
    for spec in itertools.islice(make_workload(workload, seed=0).requests(), count):
        body = spec.body(model, stream=False)
        body["max_tokens"] = 1
        if unique:
            _mark_last_turn(body)
        out.append((PATHS[spec.endpoint], json.dumps(body).encode()))
    return out


def _mark_last_turn(body: dict[str, Any]) -> None:
    mark = f" (request {UNIQUE_MARK})"
    if "prompt" in body:
        body["prompt"] += mark
        return
    last = body["messages"][-1]
    if isinstance(last["content"], str):
        last["content"] += mark
    else:
        last["content"].append({"type": "text", "text": mark})


# ---- a bare HTTP/1.1 client ----------------------------------------------------------


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


async def raw_client(
    url: str, connections: int, duration_s: float, seed: int, bodies: Bodies
) -> tuple[list[float], float]:
    """(latencies ms of 200 answers, elapsed s): ``connections`` keep-alive loops."""
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
    url: str, connections: int, duration_s: float, seed: int, bodies: Bodies, out: Any
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(raw_client(url, connections, duration_s, seed, bodies)))


def python_clients(
    url: str, processes: int, connections: int, duration_s: float, bodies: Bodies
) -> tuple[float, float, int]:
    """(req/s, p50 ms, answered) with ``connections`` spread over ``processes``."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per = max(1, connections // processes)
    procs = [
        ctx.Process(target=_client_process, args=(url, per, duration_s, c, bodies, out))
        for c in range(processes)
    ]
    for p in procs:
        p.start()
    lat: list[float] = []
    rps = 0.0
    for _ in procs:
        client_lat, elapsed_s = out.get(timeout=duration_s + 60)
        lat += client_lat
        rps += len(client_lat) / elapsed_s  # the clients run side by side
    for p in procs:
        p.join()
    return rps, statistics.median(lat), len(lat)


# ---- wrk -----------------------------------------------------------------------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
paths = {%s}
bodies = {%s}
i = 0
request = function()
  i = i + 1
  local k = (i %% #bodies) + 1
  return wrk.format(nil, paths[k], nil, (string.gsub(bodies[k], "@@N@@", tostring(i))))
end
done = function(summary, latency, requests)
  io.write(string.format("KVROUTE %%d %%d %%f %%f\\n", summary.requests,
    summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout, latency:percentile(50) / 1000,
    latency:percentile(99) / 1000))
end
"""


@dataclass(frozen=True)
class WrkResult:
    rps: float  # answered requests per second
    p50_ms: float
    p99_ms: float
    answered: int


def wrk(url: str, connections: int, duration_s: float, bodies: Bodies) -> WrkResult:
    """``wrk -t1`` cycling through ``bodies``: throughput and latency of the answered."""
    paths = ",".join(f'"{path}"' for path, _ in bodies)
    texts = ",".join(_lua_long_string(body.decode()) for _, body in bodies)
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT % (paths, texts))
        script.flush()
        cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "-s", script.name, url]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    found = re.search(r"KVROUTE (\d+) (\d+) ([\d.]+) ([\d.]+)", out)
    assert found is not None, out
    total, errors, p50, p99 = found.groups()
    ok = int(total) - int(errors)
    if int(errors):
        print(f"  ({errors} failed requests through {url})", file=sys.stderr)
    return WrkResult(ok / duration_s, float(p50), float(p99), ok)


def _lua_long_string(text: str) -> str:
    """``text`` as a Lua long string literal ([==[ ... ]==] with a level it does not contain)."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def measure_throughput(
    url: str,
    router_pid: int,
    bodies: Bodies,
    *,
    client: str,
    connections: int,
    duration_s: float,
    processes: int = 2,
) -> tuple[float, float, float]:
    """(req/s, p50 ms, router CPU us per request) with ``client`` "wrk" or "python"."""
    asyncio.run(raw_client(url, 8, 1.0, 99, bodies))  # warm-up: pools, first-use imports
    cpu0 = cpu_seconds(router_pid, children=True)
    if client == "wrk":
        got = wrk(url, connections, duration_s, bodies)
        rps, p50, count = got.rps, got.p50_ms, got.answered
    else:
        rps, p50, count = python_clients(url, processes, connections, duration_s, bodies)
    cpu1 = cpu_seconds(router_pid, children=True)
    return rps, p50, (cpu1 - cpu0) / max(1, count) * 1e6


# ---- latency with aiohttp ------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by rank, no interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(url: str, body: bytes, n: int, warmup: int = 50) -> list[float]:
    """Latency in ms of ``n`` requests sent one after another on one keep-alive connection."""
    out = []
    conn = aiohttp.TCPConnector(limit=1)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn) as s:
        for i in range(n + warmup):
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: status {r.status}")
            if i >= warmup:
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
