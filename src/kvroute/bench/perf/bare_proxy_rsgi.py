"""The floor of a router whose HTTP server is compiled: ``bare_proxy`` on granian.

The same proxy as ``bench/perf/bare_proxy`` (each POST read whole and sent to the next
backend in turn by a pooled aiohttp client, its answer returned with status and content
type; nothing else), served by granian's Rust HTTP server through its RSGI interface on
one Python worker with uvloop. Beside the aiohttp floor in ``bench/perf/router_cost``
(when granian is installed: ``pip install granian``) it shows what moving kvroute's
server layer off aiohttp would buy before any of kvroute's own work.

    python -m kvroute.bench.perf.bare_proxy_rsgi PORT BACKEND_URL [BACKEND_URL ...]
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp

BACKENDS_ENV = "KVROUTE_RSGI_BACKENDS"  # how the worker process learns its backends


class App:
    """An RSGI application (granian's ``__rsgi__`` protocol): forward, answer, repeat."""

    def __init__(self, backends: list[str]) -> None:
        self._turn: Iterator[str] = itertools.cycle(backends)
        self._session: aiohttp.ClientSession | None = None  # made on the worker's loop

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http":
            return
        if scope.method != "POST":
            protocol.response_bytes(200, [("content-type", "text/plain")], b"ok")  # /health
            return
        body = await protocol()
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"Content-Type": scope.headers.get("content-type") or "application/json"}
        url = next(self._turn) + scope.path
        async with self._session.post(url, data=body, headers=headers) as resp:
            answer = await resp.read()
            protocol.response_bytes(resp.status, [("content-type", resp.content_type)], answer)


def app_from_env() -> App:
    """The worker's app: granian imports ``kvroute.bench.perf.bare_proxy_rsgi:app``."""
    return App(os.environ[BACKENDS_ENV].split(","))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    from granian import Granian  # optional: only this floor needs it

    os.environ[BACKENDS_ENV] = ",".join(args[1:])
    server = Granian(
        "kvroute.bench.perf.bare_proxy_rsgi:app_from_env",
        address="127.0.0.1",
        port=int(args[0]),
        interface="rsgi",
        workers=1,
        loop="uvloop",
        factory=True,
        websockets=False,
        log_level="warning",
    )
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
