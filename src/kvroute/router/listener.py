"""The client-facing listeners: the split between the API and the operator endpoints,
and the answers aiohttp would otherwise give itself.

Every connection of a listener goes through the connection guard (router/guard.py:
connection caps, header and body deadlines); ``listener_middleware`` tells the guard
when a request's handler starts and ends.

Requests aiohttp's own parser refuses (a control byte in a header, a bad request line)
are answered by ``ApiRequestHandler``: a 4xx in the OpenAI error shape, logged as one line
at INFO, where aiohttp answers text/plain and logs a traceback at ERROR per request (a log
flood anyone can cause). No response names the server's software and version.

Listener roles: "all" (a single listener serves everything), or, with
``server.admin_port`` set, "api" (the API and /health) and "admin" ("/", "/metrics",
"/admin/..." and /health); each role answers 404 for the other's paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import ContentEncodingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from kvroute.router import admin
from kvroute.router.body import encoding_error
from kvroute.router.config import RouterConfig
from kvroute.router.errors import error_bytes
from kvroute.router.guard import ADMIN_MAX_CONNECTIONS, GUARD, ConnectionGuard, GuardCollector
from kvroute.router.state import STATE

log = logging.getLogger("kvroute.router.listener")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SERVER_HEADER = "kvroute"  # instead of aiohttp's "Python/3.x aiohttp/3.x.y"
DRAIN_MARGIN_S = 2.0  # aiohttp's shutdown waits this much past the router's drain


class ApiRequestHandler(RequestHandler):
    """aiohttp's connection handler, with the errors it answers itself (requests its
    parser refused) in the OpenAI shape and logged without a traceback; a 5xx (a bug)
    keeps aiohttp's handling and its traceback."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        reason = (getattr(exc, "message", None) or message or "").strip()
        log.info("malformed request from %s: %d %s", request.remote, status, reason[:200])
        if request.writer.output_size > 0:
            raise ConnectionError("a response was sent already; closing the connection")
        if isinstance(exc, ContentEncodingError):
            # a body in an encoding aiohttp cannot decode (br and zstd need modules it
            # asks to install) or that does not inflate: the client's, said as such
            err = encoding_error(reason)
            status, body = err.status, error_bytes(err.message, err.error_type, err.code)
        elif isinstance(exc, LineTooLong) and _is_request_target(exc.args[0]):
            status = 414  # RFC 9110 section 15.5.15, the URL's own status
            body = error_bytes(
                f"URI too long: the request target is longer than {exc.args[1]} bytes",
                "invalid_request_error",
                "uri_too_long",
            )
        elif isinstance(exc, LineTooLong) or reason == "Too many headers received":
            # RFC 6585's status, without echoing the client's bytes back
            limit = exc.args[1] if isinstance(exc, LineTooLong) else None
            status = 431
            body = error_bytes(
                "request header fields too large: "
                + (
                    f"a header line or the request line is longer than {limit} bytes"
                    if limit is not None
                    else "too many header fields"
                ),
                "invalid_request_error",
                "header_fields_too_large",
            )
        else:
            body = error_bytes(
                f"malformed HTTP request: {reason.splitlines()[0] if reason else status}",
                "invalid_request_error",
                "bad_http_request",
            )
        resp = web.Response(
            status=status,
            body=body,
            content_type="application/json",
            headers={"Server": SERVER_HEADER},
        )
        resp.force_close()
        return resp


def _is_request_target(line: object) -> bool:
    """Whether a line aiohttp's parser found too long is the request line's target (a
    path or an absolute URL), not a header field."""
    return isinstance(line, bytes | bytearray | str) and (
        line[:1] in (b"/", "/") or line[:4].lower() in (b"http", "http")
    )


def make_request_handler(server: web.Server) -> RequestHandler:
    """What ``server()`` makes, as an ApiRequestHandler (with the runner's settings)."""
    return ApiRequestHandler(server, loop=server._loop, **server._kwargs)


async def server_header(request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare hook: every response names kvroute, not its stack; an
    HTTP/1.0 answer of no known length (a stream) closes its connection, the only end
    an HTTP/1.0 client can see (aiohttp 3.14 keeps a keep-alive one open after it: the
    client waited for the keep-alive timeout).

    Also closed: a connection that asked to upgrade (never switched, no 101: aiohttp
    takes what follows for the new protocol's bytes, so pipelined requests were lost),
    and one whose client waits for "100 Continue" and got this answer instead (the body
    it holds back is not read past)."""
    response.headers["Server"] = SERVER_HEADER
    if (
        (request.version < HttpVersion11 and response.content_length is None)
        or "Upgrade" in request.headers
        or ("Expect" in request.headers and not request.content.is_eof())
    ):
        response.force_close()
        if request.version >= HttpVersion11:  # aiohttp wrote its headers before this hook
            response.headers["Connection"] = "close"


def is_operator_path(path: str) -> bool:
    return path in ("/", "/metrics") or path.startswith("/admin/")


@web.middleware
async def listener_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Deadlines of the connection's request; which paths the listener serves; the admin
    key on "/" and "/metrics" when ``server.metrics_auth`` is on."""
    guard = request.app.get(GUARD)
    conn = guard.started(request) if guard is not None else None
    try:
        if request.version.major != 1:  # "HTTP/2.0" in an HTTP/1 request line
            raise web.HTTPVersionNotSupported()
        coding = request.headers.get("Transfer-Encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # RFC 9112 6.1: a transfer coding the router does not apply (gzip, chunked)
            raise web.HTTPNotImplemented()

        path = request.path
        role = conn.role if conn is not None else "all"
        if role != "all" and path != "/health" and is_operator_path(path) != (role == "admin"):
            raise web.HTTPNotFound()
        if path in ("/", "/metrics") and request.app[STATE].config.server.metrics_auth:
            admin.authorize(request)
        return await handler(request)
    finally:
        if conn is not None:
            ConnectionGuard.finished(conn)


class GuardedSite(web.BaseSite):
    """A TCP listener whose connections go through a ConnectionGuard with a role."""

    __slots__ = ("_guard", "_host", "_port", "_reuse_port", "role")

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        role: str,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self.role = role
        self._host = host
        self._port = port  # the bound port once started (port 0 picks one)
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() made the server"
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(partial(make_request_handler, server), self.role),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
        )
        self._port = self._server.sockets[0].getsockname()[1]


class ListenError(OSError):
    """A listener could not bind its address; the message names the address, the
    flags that set it, the reason and what to do (``kvroute serve`` prints it)."""


def describe_bind_error(exc: OSError, host: str, port: int, flags: tuple[str, str]) -> str:
    """Why binding ``host:port`` failed and what to do; ``flags``: the host and port
    flags that chose the address (e.g. ``("--host", "--port")``)."""
    host_flag, port_flag = flags
    where = f"cannot listen on {host}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"{where}: {host_flag} {host!r} is not an address or a name that resolves"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: the port is in use; stop what listens there or choose another {port_flag}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine; fix {host_flag}"
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges); fix {port_flag}"
    return f"{where}: {exc.strerror or exc}"


@contextlib.contextmanager
def naming_flags(host: str, port: int, flags: tuple[str, str]) -> Iterator[None]:
    """Turn an OSError of the bind inside into a ListenError that names ``flags``."""
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        error = ListenError(describe_bind_error(exc, host, port, flags))
        error.errno = exc.errno
        raise error from exc


@dataclass(slots=True)
class Listeners:
    """A running router's runner, guard and bound addresses."""

    runner: web.AppRunner
    guard: ConnectionGuard
    api: tuple[str, int]  # the API listener (everything when there is no admin listener)
    admin: tuple[str, int] | None  # the admin listener, when configured
    private: tuple[str, int] | None = None  # a worker's own port (--worker-port-base)


async def start_listeners(
    app: web.Application,
    config: RouterConfig,
    *,
    reuse_port: bool = False,
    private_port: int | None = None,
) -> Listeners:
    """Set up ``app`` (from ``make_app``) and start its listeners; ``runner.cleanup()``
    stops them and drains. ``reuse_port``: the ports are shared with other workers.
    ``private_port``: a worker's own extra listener (operator role when split).
    A listener that cannot bind raises ListenError."""
    server = config.server
    guard = ConnectionGuard(server)
    app[GUARD] = guard
    app.cleanup_ctx.append(guard.run)
    app[STATE].metrics.add_collector(GuardCollector(guard))
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client disconnect cancels its upstream request
        # the app ends what is left at drain_timeout_s (app._end_drain) and answers it;
        # aiohttp's own cut must come after that, or it races the answers being written
        shutdown_timeout=config.drain_timeout_s + DRAIN_MARGIN_S,
        access_log=None,
        keepalive_timeout=server.keepalive_s,
        auto_decompress=False,  # bodies inflate bounded by the limit (router/body.py)
    )
    await runner.setup()
    split = server.has_admin_listener
    try:
        api = GuardedSite(runner, guard, "api" if split else "all", config.host, config.port,
                          reuse_port=reuse_port, backlog=1024)  # fmt: skip
        with naming_flags(config.host, config.port, ("--host", "--port")):
            await api.start()
        listeners = Listeners(runner, guard, api.address, None)
        if server.admin_port is not None:
            host = server.admin_host or config.host
            site = GuardedSite(runner, guard, "admin", host, server.admin_port,
                               reuse_port=reuse_port)  # fmt: skip
            with naming_flags(host, server.admin_port, ("--admin-host", "--admin-port")):
                await site.start()
            listeners.admin = site.address
        if private_port is not None:
            role = "admin" if split else "all"
            site = GuardedSite(runner, guard, role, config.host, private_port)
            with naming_flags(config.host, private_port, ("--host", "--worker-port-base")):
                await site.start()
            listeners.private = site.address
    except BaseException:
        await runner.cleanup()
        raise
    return listeners


def ensure_fd_limit(config: RouterConfig) -> None:
    """Raise the soft open-file limit to what the caps need (client connections, the
    upstream pool, probes, slack), within the hard limit; warn when that is not enough."""
    needed = (
        config.server.max_client_connections
        + ADMIN_MAX_CONNECTIONS
        + config.limits.max_connections
        + 3 * max(1, len(config.backends))
        + 256
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "open-file limit %d is below the %d the connection caps need "
            "(server.max_client_connections, limits.max_connections): raise ulimit -n",
            soft,
            needed,
        )
