"""Relaying one upstream response to the client, after its headers arrived.

Non-streaming: the body is read whole, up to ``limits.max_response_bytes``, and answered
with the backend's status. It is capped rather than passed through: the router reads the
answer's ``usage`` (cached tokens) and can still answer a clean 502 when a backend sends
something no completion is (a real answer, logprobs included, is kilobytes to a few MB),
while a pass-through would already have sent a 200 when a body turns out endless.
Streaming (``text/event-stream``): each chunk is written as it arrives, never buffered.
One ``asyncio.timeout`` guards the loop: before a read its deadline is the idle gap (capped
by the total deadline), before a write the total deadline. A stream silent for the idle
gap goes on while the engine is alive and working (``_keep_waiting``), up to
``timeouts.stall_s``. A backend failure after the first byte ends the stream with an SSE
error event and ``[DONE]``, never a retry. A client that goes away closes the upstream
response, so the engine aborts the request.

Neither a cut body nor a slow one counts against the backend's circuit: either may be
what this request caused (health probes tell a dead backend apart). Only a stream cut
because its backend's probes failed is charged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision
from kvroute.router.breaker import CircuitState
from kvroute.router.errors import BackendFailed, BackendTimeout
from kvroute.router.state import NOTE, RouterState
from kvroute.router.upstream import Deadline, copy_response_headers

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _headers(resp: aiohttp.ClientResponse, url: str, reason: str, rid: str) -> dict[str, str]:
    headers = copy_response_headers(resp)
    headers["x-kvroute-backend"] = url
    headers["x-kvroute-decision"] = reason
    headers["x-request-id"] = rid
    return headers


async def relay(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    decision: Decision,
    deadline: Deadline,
) -> tuple[bool, web.StreamResponse]:
    """(ok, the response sent or to send); closes ``resp`` whatever happens.

    ``ok`` is False only when the backend failed (cut or stalled body); a 4xx answer or a
    client that went away is ok for the backend's accounting.
    """
    try:
        headers = _headers(resp, decision.backend, decision.reason, request[NOTE].request_id)
        if resp.content_type == "text/event-stream":
            return await _relay_stream(state, request, resp, ticket, headers, deadline)
        return await _relay_whole(state, request, resp, ticket, headers, deadline)
    finally:
        resp.close()  # no-op for the pooled connection once the body was read to EOF


async def _relay_whole(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    headers: dict[str, str],
    deadline: Deadline,
) -> tuple[bool, web.StreamResponse]:
    url, cap = ticket.url, state.config.limits.max_response_bytes
    try:
        async with asyncio.timeout_at(deadline.at):
            body = await _read_capped(resp, cap)
    except TimeoutError:
        msg = f"{url} did not finish its answer within {deadline.describe()}"
        raise BackendTimeout(msg) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendFailed(f"{url}: answer cut: {type(exc).__name__}") from None
    if body is None:
        raise BackendFailed(f"{url} sent an answer over {cap} bytes (limits.max_response_bytes)")
    now = state.clock()
    state.fleet.on_first_token(ticket, now, _cached_tokens(body))
    state.metrics.of(url).ttft.observe(now - request[NOTE].t0)
    return True, web.Response(body=body, status=resp.status, headers=headers)


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The whole body, or None as soon as it is known to exceed ``cap`` bytes (the caller
    then closes the connection, so the rest is never read)."""
    if resp.content_length is not None and resp.content_length > cap:
        return None
    parts, size = [], 0
    while chunk := await resp.content.readany():
        size += len(chunk)
        if size > cap:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _cached_tokens(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the engine reports it."""
    if b'"cached_tokens"' not in body:
        return None
    try:
        usage = _decode(body).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (msgspec.DecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _relay_stream(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    headers: dict[str, str],
    total: Deadline,
) -> tuple[bool, web.StreamResponse]:
    url = ticket.url
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    relay = _StreamRelay(state, request, resp, ticket, out, total)
    loop = asyncio.get_running_loop()
    wait_s = state.config.timeouts.idle_s
    try:
        while True:
            try:
                if await relay.pump(wait_s):
                    break
            except TimeoutError:
                if loop.time() >= total.at:
                    raise _Cut(f"request exceeded {total.describe()}") from None
                # silent for a while: go on while the engine says it is working on it
                wait_s = _keep_waiting(state, url, loop.time() - relay.last_chunk_at)
    except ClientGone:
        state.metrics.client_disconnects.inc()
        return True, out  # the backend did not fail; resp.close() in relay() cancels it
    except (_Cut, aiohttp.ClientError, OSError) as exc:
        state.metrics.midstream_failures.labels(url).inc()
        await _write_sse_error(out, exc, relay.tail)
        return False, out
    cached = _stream_cached_tokens(relay.last)
    if cached is not None:
        state.fleet.record_cached_tokens(ticket, cached)
    try:
        await out.write_eof()
    except ConnectionError:  # the client closed after the last event ([DONE]): not a failure
        state.metrics.client_disconnects.inc()
    return True, out


class _StreamRelay:
    """One stream's copy loop and what it has seen (resumable after a silent spell)."""

    __slots__ = ("first", "last", "last_chunk_at", "loop", "out", "request", "resp", "state",
                 "tail", "ticket", "total")  # fmt: skip

    def __init__(
        self,
        state: RouterState,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        ticket: Ticket,
        out: web.StreamResponse,
        total: Deadline,
    ) -> None:
        self.state, self.request, self.ticket = state, request, ticket
        self.resp, self.out, self.total = resp, out, total
        self.loop = asyncio.get_running_loop()
        self.first = True
        self.tail = b"\n\n"  # end of the last chunk written: is an SSE event open?
        self.last = b""  # the stream's last bytes: the usage chunk (cached_tokens) is last
        self.last_chunk_at = self.loop.time()

    async def pump(self, wait_s: float) -> bool:
        """Copy chunks until the end (True); TimeoutError after ``wait_s`` without one (or
        at the total deadline). One ``asyncio.timeout``, rescheduled: no task per chunk."""
        read, deadline, loop = self.resp.content.readany, self.total.at, self.loop
        idle_s = self.state.config.timeouts.idle_s
        async with asyncio.timeout(None) as guard:
            while True:
                guard.reschedule(min(deadline, loop.time() + wait_s))
                chunk = await read()
                if not chunk:
                    return True
                self.last_chunk_at = loop.time()
                wait_s = idle_s
                if self.first:
                    self._first_token()
                guard.reschedule(deadline)
                try:
                    await self.out.write(chunk)
                except ConnectionError:
                    raise ClientGone from None
                self.tail = chunk[-2:]
                self.last = (self.last + chunk)[-_USAGE_TAIL_BYTES:]

    def _first_token(self) -> None:
        self.first = False
        now = self.state.clock()
        self.state.fleet.on_first_token(self.ticket, now)
        self.state.metrics.of(self.ticket.url).ttft.observe(now - self.request[NOTE].t0)


class _Cut(Exception):
    """The router ends a silent stream; the message says why (sent in the SSE error)."""


def _keep_waiting(state: RouterState, url: str, silent_s: float) -> float:
    """How much longer to wait for a stream silent ``silent_s`` (>= idle_s); _Cut if not.

    Waited for: a healthy backend (probes pass, circuit not open) whose last scraped
    gauges show requests running or waiting, until ``stall_s``: an overloaded engine
    preempts requests and resumes them later. Without gauges (no scraper, or an engine
    that does not export them) the idle gap alone decides, as it did.
    """
    timeouts = state.config.timeouts
    gap = f"no token for {silent_s:.3g} s"
    rt = state.backends.get(url)
    if rt is None or not rt.probe_ok or rt.breaker.state is CircuitState.OPEN:
        state.backends.record_failure(url, f"stream stalled, backend unhealthy ({gap})")
        raise _Cut(f"backend stalled mid-stream: {gap} and the backend is unhealthy")
    engine = rt.engine
    if engine is None or (engine.num_running is None and engine.num_waiting is None):
        raise _Cut(f"backend stalled mid-stream: {gap} (timeouts.idle_s); its load is unknown")
    if (engine.num_running or 0) + (engine.num_waiting or 0) == 0:
        raise _Cut(f"backend stalled mid-stream: {gap}; the engine reports no running or "
                   "waiting request")  # fmt: skip
    stall_s = max(timeouts.stall_s, timeouts.idle_s)
    if silent_s >= stall_s:
        raise _Cut(f"backend stalled mid-stream: {gap} (timeouts.stall_s), though the "
                   "engine reports work")  # fmt: skip
    # look again soon: the engine may go idle or its health probes fail meanwhile
    return min(timeouts.idle_s, state.config.health.interval_s, stall_s - silent_s)


_USAGE_TAIL_BYTES = 4096  # a usage chunk is a few hundred bytes


def _stream_cached_tokens(tail: bytes) -> int | None:
    """``cached_tokens`` of the stream's usage chunk (``stream_options.include_usage``)."""
    if b'"cached_tokens"' not in tail:
        return None
    for event in reversed(tail.split(b"\n\n")):
        if b'"cached_tokens"' in event and event.startswith(b"data: "):
            return _cached_tokens(event[6:])
    return None


class ClientGone(Exception):
    """Writing to the client failed: it disconnected (not a backend failure)."""


def error_note(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object of the SSE error event sent after the first byte."""
    if isinstance(exc, _Cut):
        return {"message": str(exc), "type": "api_error", "code": 504}
    msg = f"backend failed mid-stream: {type(exc).__name__}"
    return {"message": msg, "type": "api_error", "code": 502}


async def _write_sse_error(out: web.StreamResponse, exc: BaseException, tail: bytes) -> None:
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    event = sep + b"data: " + _encode({"error": error_note(exc)}) + b"\n\ndata: [DONE]\n\n"
    try:
        await out.write(event)
        await out.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass  # the client left too; nothing more to tell it
