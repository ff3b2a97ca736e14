"""The floor of any router built on aiohttp: a proxy that does nothing else.

Each POST is read whole, sent to the next backend in turn (aiohttp client, pooled
keep-alive connections, uvloop as ``kvroute serve`` runs) and its answer returned with its
status and content type. No parsing, keys, routing, deadlines, metrics or headers: what
is left of a request's cost here is the HTTP server, the HTTP client and the kernel.
``bench/perf/router_cost`` runs it beside kvroute to show how much of kvroute's cost is
kvroute's own.

    python -m kvroute.bench.perf.bare_proxy PORT BACKEND_URL [BACKEND_URL ...]
"""

from __future__ import annotations

import itertools
import sys

import aiohttp
from aiohttp import web

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


def make_app(backends: list[str]) -> web.Application:
    turn = itertools.cycle(backends)

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": request.content_type}
        async with request.app[SESSION].post(next(turn) + request.path, data=body,
                                             headers=headers) as resp:  # fmt: skip
            answer = await resp.read()
            return web.Response(body=answer, status=resp.status, content_type=resp.content_type)

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(session)
    return app


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    import uvloop

    uvloop.install()
    web.run_app(make_app(args[1:]), host="127.0.0.1", port=int(args[0]), access_log=None,
                print=None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
