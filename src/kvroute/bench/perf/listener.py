"""What the client-connection guard (router/guard.py) costs the router.

1. Router CPU per request, plain aiohttp listener vs the guarded one: the router runs in a
   child process on uvloop (one dead backend: every ``GET /health`` answers 503 through
   the whole middleware chain); this process sends the requests over keep-alive
   connections, or a new connection per request; the figure is the child's CPU time
   (user + system, from /proc) per request, the best of ``--rounds``.
2. One sweep over N open connections (``ConnectionGuard.sweep``), in-process.

    python -m kvroute.bench.perf.listener [--requests 20000] [--connections 10000]

(``scripts/bench_listener.py`` runs the same.)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection

import aiohttp
from aiohttp import web

from kvroute.bench.procs import cpu_seconds
from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, HealthConfig, RouterConfig, ServerConfig
from kvroute.router.guard import ConnectionGuard, GuardedProtocol
from kvroute.router.listener import start_listeners


def _config() -> RouterConfig:
    return RouterConfig(
        backends=(BackendConfig(url="http://127.0.0.1:9"),),
        port=0,
        health=HealthConfig(interval_s=3600, timeout_s=0.2, scrape_interval_s=0),
        server=ServerConfig(max_client_connections=100_000),
    )


async def _serve(kind: str, conn: Connection) -> None:
    config = _config()
    app = make_app(config)
    if kind == "guarded":
        listeners = await start_listeners(app, config)
        runner, port = listeners.runner, listeners.api[1]
    else:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
    conn.send(port)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    await runner.cleanup()


def _child(kind: str, conn: Connection) -> None:
    import uvloop

    uvloop.run(_serve(kind, conn))


async def _load(port: int, num_requests: int, fresh: bool) -> None:
    url = f"http://127.0.0.1:{port}/health"
    connector = aiohttp.TCPConnector(limit=32, force_close=fresh)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.get(url) as resp:
                    await resp.read()

        await asyncio.gather(*(worker(num_requests // 32) for _ in range(32)))


def cpu_per_request_us(kind: str, num_requests: int, fresh: bool, rounds: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(kind, child))
    proc.start()
    try:
        port = parent.recv()
        asyncio.run(_load(port, 2000, fresh))  # warm-up
        best = float("inf")
        for _ in range(rounds):
            before = cpu_seconds(proc.pid)  # type: ignore[arg-type]
            asyncio.run(_load(port, num_requests, fresh))
            best = min(best, cpu_seconds(proc.pid) - before)  # type: ignore[arg-type]
        return 1e6 * best / num_requests
    finally:
        parent.send("stop")
        proc.join(30)


class _Transport:
    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def sweep_us(num_connections: int) -> float:
    """Microseconds of one sweep over ``num_connections`` idle kept-alive connections."""
    guard = ConnectionGuard(ServerConfig(max_client_connections=10**6), clock=time.monotonic)
    for _ in range(num_connections):
        conn = GuardedProtocol(guard, object, "api")  # type: ignore[arg-type]
        conn.handler, conn.transport, conn.num_requests = object(), _Transport(), 1  # type: ignore[assignment]
        guard.register(conn)
    t0 = time.perf_counter()
    for _ in range(20):
        guard.sweep(time.monotonic())
    return 1e6 * (time.perf_counter() - t0) / 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=10_000)
    args = p.parse_args(argv)
    for fresh in (False, True):
        mode = "new connection per request" if fresh else "keep-alive"
        figures = {k: cpu_per_request_us(k, args.requests, fresh, args.rounds)
                   for k in ("plain", "guarded")}  # fmt: skip
        print(f"{mode}: router CPU per request: plain {figures['plain']:.1f} us, "
              f"guarded {figures['guarded']:.1f} us")  # fmt: skip
    print(f"one sweep over {args.connections} connections: {sweep_us(args.connections):.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
