"""The client-connection guard: timeouts for slow and idle clients, and a connection cap.

aiohttp's server closes idle keep-alive connections (``keepalive_timeout``) but has no
deadline for a request's headers or body and no cap on connections: idle, partial-header
and slow-body connections stay open for good. So each accepted connection gets a thin
protocol in front of aiohttp's own (``GuardedProtocol``). It refuses the connection when
its listener is full (503, closed at once) and notes when the first byte of a request
arrives while no request is being handled; the listeners' middleware
(router/listener.py) marks when a request's headers are complete (its handler starts)
and when it ends. A sweep every ``tick_s`` walks the open connections: one still waiting
for its headers ``header_timeout_s`` after the connection opened (first request) or
after the request's first byte (later requests) is closed; a request whose body is not
whole ``body_timeout_s`` after its headers gets 408 (its body read raises
``RequestTimeout``). An idle kept-alive connection is aiohttp's: closed after
``keepalive_s`` (which also bounds a pipelined request whose first bytes came while the
one before it was handled: its header clock never started).

Cost: one extra Python call per received chunk, a dict lookup and two attribute writes
per request, and a sweep over the open connections per tick (at most once a second).
The guard's figures are exported at scrape time (``GuardCollector``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.router.config import ServerConfig
from kvroute.router.errors import RequestTimeout, error_bytes

ADMIN_MAX_CONNECTIONS = 128  # the admin listener's own cap: a flood of the API leaves it be
_BUSY_BODY = error_bytes(
    "too many client connections; retry later", "api_error", "too_many_connections"
)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" % len(_BUSY_BODY)
) + _BUSY_BODY


class GuardedProtocol(asyncio.Protocol):
    """One client connection: the guard's bookkeeping in front of aiohttp's handler.

    The aiohttp handler is made only once the connection is admitted; every transport
    callback goes on to it unchanged.
    """

    __slots__ = (
        "_guard",
        "_make_handler",
        "body_deadline",
        "first_byte_at",
        "handler",
        "num_requests",
        "opened_at",
        "request",
        "role",
        "transport",
    )

    def __init__(
        self, guard: ConnectionGuard, make_handler: Callable[[], RequestHandler], role: str
    ) -> None:
        self._guard = guard
        self._make_handler = make_handler
        self.role = role
        self.handler: RequestHandler | None = None  # None: refused (or not yet made)
        self.transport: asyncio.Transport | None = None
        self.opened_at = 0.0  # loop time of the accept
        self.first_byte_at: float | None = None  # first byte of a request not yet handled
        self.num_requests = 0  # requests whose handler started
        self.request: web.BaseRequest | None = None  # the request being handled
        self.body_deadline: float | None = None  # its body must be whole by then

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's is not an asyncio.Transport subclass, hence no check)
        self.transport = cast(asyncio.Transport, transport)
        self.opened_at = self._guard.now()
        if not self._guard.admit(self):
            self.transport.write(_BUSY)
            self.transport.close()
            return
        self.handler = self._make_handler()
        self._guard.register(self)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        if handler is None:
            return
        if self.request is None and self.first_byte_at is None:
            self.first_byte_at = self._guard.now()
        handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handler is not None:
            self._guard.forget(self)
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()


class ConnectionGuard:
    """The open client connections of one process, their caps and deadlines."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.now = clock or asyncio.get_running_loop().time
        self._by_handler: dict[RequestHandler, GuardedProtocol] = {}
        self._caps = {"admin": ADMIN_MAX_CONNECTIONS}  # other roles: max_client_connections
        self.num_open: dict[str, int] = {}  # role -> open connections
        self.num_refused: dict[str, int] = {}  # role -> connections refused (cap)
        self.num_header_timeouts = 0
        self.num_body_timeouts = 0
        shortest_s = min(config.header_timeout_s, config.body_timeout_s)
        self.tick_s = min(1.0, max(0.02, shortest_s / 4))  # a deadline is late by <= tick_s

    def factory(
        self, make_handler: Callable[[], RequestHandler], role: str
    ) -> Callable[[], GuardedProtocol]:
        """The protocol factory of a listener with this role; ``make_handler`` makes the
        aiohttp handler of each admitted connection."""
        return lambda: GuardedProtocol(self, make_handler, role)

    def admit(self, conn: GuardedProtocol) -> bool:
        role = conn.role
        cap = self._caps.get(role, self.config.max_client_connections)
        if self.num_open.get(role, 0) >= cap:
            self.num_refused[role] = self.num_refused.get(role, 0) + 1
            return False
        self.num_open[role] = self.num_open.get(role, 0) + 1
        return True

    def register(self, conn: GuardedProtocol) -> None:
        assert conn.handler is not None, "registered once its handler exists"
        self._by_handler[conn.handler] = conn

    def forget(self, conn: GuardedProtocol) -> None:
        if conn.handler is not None and self._by_handler.pop(conn.handler, None) is not None:
            self.num_open[conn.role] -= 1

    def started(self, request: web.BaseRequest) -> GuardedProtocol | None:
        """A request's handler starts: its headers are complete; its body clock starts."""
        conn = self._by_handler.get(request.protocol)
        if conn is None:
            return None  # not one of ours (a test server)
        conn.request = request
        conn.first_byte_at = None
        conn.num_requests += 1
        if not request.content.is_eof():
            conn.body_deadline = self.now() + self.config.body_timeout_s
        return conn

    @staticmethod
    def finished(conn: GuardedProtocol) -> None:
        conn.request = None
        conn.body_deadline = None

    def sweep(self, now: float) -> None:
        """Close connections late with their headers; fail bodies late to arrive."""
        header_s = self.config.header_timeout_s
        for conn in list(self._by_handler.values()):
            request = conn.request
            if request is None:
                since = conn.first_byte_at
                if since is None and conn.num_requests == 0:
                    since = conn.opened_at  # a new connection owes its first request
                transport = conn.transport
                late = since is not None and now - since > header_s
                if late and transport is not None and not transport.is_closing():
                    self.num_header_timeouts += 1
                    transport.close()
            elif conn.body_deadline is not None and now > conn.body_deadline:
                conn.body_deadline = None
                if not request.content.is_eof():
                    self.num_body_timeouts += 1
                    limit = self.config.body_timeout_s
                    request.content.set_exception(
                        RequestTimeout(f"request body not complete within {limit:g} s")
                    )

    async def run(self, app: web.Application) -> AsyncIterator[None]:
        """Cleanup context: the sweep runs while the app does (and while it drains)."""

        async def sweep_forever() -> None:
            while True:
                await asyncio.sleep(self.tick_s)
                self.sweep(self.now())

        task = asyncio.get_running_loop().create_task(sweep_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


GUARD: web.AppKey[ConnectionGuard] = web.AppKey("kvroute_guard", ConnectionGuard)


class GuardCollector(Collector):
    """Scrape-time figures of the guard: open and refused connections, timeouts."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = self._guard
        open_ = GaugeMetricFamily(
            "kvroute_client_connections", "Open client connections", labels=["listener"]
        )
        refused = CounterMetricFamily(
            "kvroute_client_connections_refused",
            "Client connections refused at once (listener over its connection cap)",
            labels=["listener"],
        )
        for role in sorted(set(g.num_open) | set(g.num_refused)):
            open_.add_metric([role], g.num_open.get(role, 0))
            refused.add_metric([role], g.num_refused.get(role, 0))
        timeouts = CounterMetricFamily(
            "kvroute_client_timeouts",
            "Client requests cut: headers (connection closed) or body (408) too slow",
            labels=["kind"],
        )
        timeouts.add_metric(["header"], g.num_header_timeouts)
        timeouts.add_metric(["body"], g.num_body_timeouts)
        yield from (open_, refused, timeouts)
