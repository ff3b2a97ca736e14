"""CORS: browser apps on other origins may call the API (``server.cors_origins``).

Off by default, as in nginx or Envoy: a browser on the operator's network could otherwise
be made to spend the fleet's GPUs by any web page it visits. vLLM allows every origin by
default, so a browser app that called vLLM directly needs ``--cors-origin '*'`` (or its
own origin) behind kvroute.

Two parts: a middleware answers preflights (``OPTIONS`` with
``Access-Control-Request-Method``) itself, before the routes and the client-key check,
which a preflight never carries a key for; and a response hook stamps every answer to an
allowed origin, streams and errors included, before its headers go out. No credentials
mode: the API takes its key in the Authorization header, which a page sets itself, never
cookies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from kvroute.router.errors import error_bytes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# what a page may read of an answer besides the CORS-safelisted headers
EXPOSED = ", ".join(
    (
        "x-request-id",
        "x-kvroute-backend",
        "x-kvroute-decision",
        "x-kvroute-predicted-cached-tokens",
        "x-kvroute-left-cached-tokens",
        "retry-after",
    )
)
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    """The allowed origins (``*``: any) and the two aiohttp hooks that apply them."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allow(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for ``origin``; None: not allowed."""
        if origin is None:
            return None
        if self.any:
            return "*"
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if self.allow(request.headers.get("Origin")) is None:
                body = error_bytes("this origin may not call the API (server.cors_origins)",
                                   "invalid_request_error", "origin_not_allowed")  # fmt: skip
                return web.Response(status=403, body=body, content_type="application/json")
            headers = {
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            }
            asked = request.headers.get("Access-Control-Request-Headers")
            if asked:  # whatever the page will set (Authorization, Content-Type, x-...)
                headers["Access-Control-Allow-Headers"] = asked
            return web.Response(status=204, headers=headers)
        return await handler(request)

    async def stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: every answer to an allowed origin says so."""
        allowed = self.allow(request.headers.get("Origin"))
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != "*":  # the answer depends on the origin: caches must know
            response.headers.add("Vary", "Origin")
        if request.method != "OPTIONS":
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
