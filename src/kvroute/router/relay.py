"""Relaying one upstream response to the client, after its headers arrived.

Assembled (a non-streaming client whose request the proxy turned into a stream, see
router/assemble.py): the stream is read under the whole answer's deadline, its first
chunk is the first token (the prefill rate learns, queued prefill is released), and the
client gets one JSON body built from the chunks; a cut, an error event or a bad event is
a 502, nothing having been sent yet.
Non-streaming: the body is read whole, up to ``limits.max_response_bytes``, and answered
with the backend's status. Its end is not a first token, so no prefill rate is learned
from it (the prompt stays queued prefill until the end); its usage still reports the
engine's cached tokens. It is capped rather than passed through: the router reads the
answer's ``usage`` (cached tokens) and can still answer a clean 502 when a backend sends
something no completion is (a real answer, logprobs included, is kilobytes to a few MB),
while a pass-through would already have sent a 200 when a body turns out endless.
Streaming (``text/event-stream``): each chunk is written as it arrives, never buffered.
One ``asyncio.timeout`` guards a stream's loop: before a read its deadline is the idle gap (capped
by the total deadline), before a write the total deadline. A stream silent for the idle
gap goes on while the engine is alive and working (``_keep_waiting``), up to
``timeouts.stall_s``. A backend failure after the first byte ends the stream with an SSE
error event and ``[DONE]``, never a retry; so does a stream the backend closes cleanly
before its ``[DONE]`` (every OpenAI-compatible engine ends with one). A client that goes
away closes the upstream response, so the engine aborts the request.

Neither a cut body nor a slow one counts against the backend's circuit: either may be
what this request caused (health probes tell a dead backend apart). Only a stream cut
because its backend's probes failed is charged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision
from kvroute.router.assemble import AssemblyError, StreamAssembler
from kvroute.router.breaker import CircuitState
from kvroute.router.cutoff import cutoff_at
from kvroute.router.errors import BackendFailed, BackendTimeout, NoHealthyBackend
from kvroute.router.state import NOTE, RouterState
from kvroute.router.upstream import Deadline, copy_response_headers

_encode = msgspec.json.Encoder().encode


class _Usage(msgspec.Struct):
    """An answer's ``usage`` (and llama.cpp's ``timings``) alone: every other field is
    skipped, not built."""

    usage: Any = None
    timings: Any = None


_decode_answer = msgspec.json.Decoder(_Usage).decode


def _decode_usage(data: bytes) -> Any:
    """The answer's usage in OpenAI's shape: llama.cpp before its PR #19361 gave the
    cached prompt tokens only as ``timings.cache_n``, moved here into
    ``prompt_tokens_details``."""
    answer = _decode_answer(data)
    usage, timings = answer.usage, answer.timings
    if (
        isinstance(usage, dict)
        and isinstance(timings, dict)
        and not isinstance(usage.get("prompt_tokens_details"), dict)
    ):
        cached = timings.get("cache_n")
        if _is_int(cached):
            usage = {**usage, "prompt_tokens_details": {"cached_tokens": cached}}
    return usage


def _headers(
    resp: aiohttp.ClientResponse, ticket: Ticket, decision: Decision, rid: str
) -> CIMultiDict[str]:
    headers = copy_response_headers(resp)
    headers["x-kvroute-backend"] = ticket.url
    headers["x-kvroute-decision"] = decision.reason
    # the hit the router expected on this backend (Fleet.dispatch computed it for the
    # backend that answers, a retry's included): tells a routing error from a miss
    headers["x-kvroute-predicted-cached-tokens"] = str(ticket.predicted_cached_tokens)
    if decision.left_cached_tokens:  # moved away from its prefix's holder: what that gave up
        headers["x-kvroute-left-cached-tokens"] = str(decision.left_cached_tokens)
    headers["x-request-id"] = rid
    return headers


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    """How one request's answer is relayed (decided per attempt: router/outbound.py)."""

    assembled: bool = False  # a stream asked for a non-streaming client: answer one body
    chat: bool = False  # /v1/chat/completions (else /v1/completions): the body's shape
    model: str | None = None  # the routed model (its bytes per token learn from usage)
    # UTF-8 bytes of the one text prompt the router keyed (approximate keys); None: the
    # usage's prompt_tokens teaches nothing (token keys, token ids, a batch)
    text_bytes: int | None = None


WHOLE = AnswerPlan()


async def relay(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    decision: Decision,
    deadline: Deadline,
    plan: AnswerPlan = WHOLE,
) -> tuple[bool, web.StreamResponse]:
    """(ok, the response sent or to send); closes ``resp`` whatever happens.

    ``ok`` is False only when the backend failed (cut or stalled body); a 4xx answer or a
    client that went away is ok for the backend's accounting.
    """
    try:
        headers = _headers(resp, ticket, decision, request[NOTE].request_id)
        if resp.content_type == "text/event-stream":
            if plan.assembled:
                return await _relay_assembled(state, request, resp, ticket, headers, deadline,
                                              plan)  # fmt: skip
            return await _relay_stream(state, request, resp, ticket, headers, deadline, plan)
        # a whole answer (also an engine's JSON error to an assembled request's stream)
        return await _relay_whole(state, request, resp, ticket, headers, deadline, plan)
    finally:
        resp.close()  # no-op for the pooled connection once the body was read to EOF


async def _relay_whole(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    headers: CIMultiDict[str],
    deadline: Deadline,
    plan: AnswerPlan,
) -> tuple[bool, web.StreamResponse]:
    url, cap = ticket.url, state.config.limits.max_response_bytes
    try:
        async with cutoff_at(deadline.at):
            body = await _read_capped(resp, cap)
    except TimeoutError:
        msg = f"{url} did not finish its answer within {deadline.describe()}"
        raise BackendTimeout(msg) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendFailed(f"{url}: answer cut: {type(exc).__name__}") from None
    if body is None:
        raise BackendFailed(f"{url} sent an answer over {cap} bytes (limits.max_response_bytes)")
    if not body and resp.status < 300:  # no completion is empty: never relay it as one
        raise BackendFailed(f"{url} answered {resp.status} with an empty body")
    # the end of a whole answer is not its first token: no prefill rate is learned from
    # it, and its prefill stays queued until finish (issue 10)
    if resp.status < 300:
        rt = state.backends.get(url)
        reports = rt is not None and rt.reports_cached
        _learn_usage(state, ticket, plan, _whole_usage(body, plan, reports))
    state.metrics.of(url).ttft.observe(state.clock() - request[NOTE].t0)
    return True, web.Response(body=body, status=resp.status, headers=headers)


async def _relay_assembled(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    headers: CIMultiDict[str],
    deadline: Deadline,
    plan: AnswerPlan,
) -> tuple[bool, web.StreamResponse]:
    """Read the stream the proxy asked for and answer the one body it assembles."""
    url = ticket.url
    assembler = StreamAssembler(plan.chat, state.config.limits.max_response_bytes)
    try:
        async with cutoff_at(deadline.at):
            read = resp.content.readany
            chunk = await read()
            if chunk:
                _first_token(state, request, ticket)
            while chunk:
                assembler.feed(chunk)
                chunk = await read()  # to the end: the connection goes back to the pool
        answer = assembler.answer()
    except TimeoutError:
        msg = f"{url} did not finish its answer within {deadline.describe()}"
        raise BackendTimeout(msg) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendFailed(f"{url}: answer cut: {type(exc).__name__}") from None
    except AssemblyError as exc:
        raise BackendFailed(f"{url}: {exc}") from None
    _learn_usage(state, ticket, plan, assembler.usage)
    headers["Content-Type"] = "application/json"
    return True, web.Response(body=_encode(answer), status=resp.status, headers=headers)


def _first_token(state: RouterState, request: web.Request, ticket: Ticket) -> None:
    """The stream's first chunk: prefill is done (queued prefill released, rate learned)."""
    now = state.clock()
    state.fleet.on_first_token(ticket, now)
    state.metrics.of(ticket.url).ttft.observe(now - request[NOTE].t0)


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


def _whole_usage(body: bytes, plan: AnswerPlan, reports_cached: bool = False) -> Any:
    """A whole answer's ``usage``, when it may say something the router uses: cached
    tokens (or their absence, from a backend that reports them), or prompt tokens of a
    text prompt (decoded only then)."""
    wanted = (
        b'"cached_tokens"' in body
        or b'"cache_n"' in body
        or ((plan.text_bytes is not None or reports_cached) and b'"prompt_tokens"' in body)
    )
    if not wanted:
        return None
    try:
        return _decode_usage(body)
    except msgspec.DecodeError:  # not JSON, or not an object: nothing to learn
        return None


def _learn_usage(state: RouterState, ticket: Ticket, plan: AnswerPlan, usage: Any) -> None:
    """What an answer's usage teaches: the engine's cached tokens (predictions checked)
    and, for a text prompt, its bytes per token (approximate mode's calibration)."""
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    rt = state.backends.get(ticket.url)
    if _is_int(cached):
        if rt is not None:
            rt.reports_cached = True
        state.fleet.record_cached_tokens(ticket, cached)
    elif rt is not None and rt.reports_cached and _is_int(usage.get("prompt_tokens")):
        state.fleet.record_cached_tokens(ticket, 0)  # the field left out on a miss
    prompt_tokens = usage.get("prompt_tokens")
    if plan.text_bytes is not None and _is_int(prompt_tokens):
        state.fleet.observe_prompt_tokens(plan.model, plan.text_bytes, prompt_tokens)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _relay_stream(
    state: RouterState,
    request: web.Request,
    resp: aiohttp.ClientResponse,
    ticket: Ticket,
    headers: CIMultiDict[str],
    total: Deadline,
    plan: AnswerPlan,
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
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not state.drain_expired or task is None:
            raise
        task.uncancel()  # the router's drain ended it: tell the client why, not the backend
        await _write_sse_error(out, _Drained(DRAINED), relay.tail)
        return True, out
    except (_Cut, aiohttp.ClientError, OSError) as exc:
        state.metrics.midstream_failures.labels(url).inc()
        await _write_sse_error(out, exc, relay.tail)
        return False, out
    if not relay.last.rstrip().endswith(b"[DONE]"):  # a clean close, but not an end
        state.metrics.midstream_failures.labels(url).inc()
        if _ends_with_error(relay.last):  # the engine said why (llama.cpp): only end it
            await _write_done(out, relay.tail)
        else:
            await _write_sse_error(out, _EndedEarly(f"{url}: the stream ended before [DONE]"),
                                   relay.tail)  # fmt: skip
        return False, out
    _learn_usage(state, ticket, plan, _stream_usage(relay.last))
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
                    self.first = False
                    _first_token(self.state, self.request, self.ticket)
                guard.reschedule(deadline)
                try:
                    await self.out.write(chunk)
                except ConnectionError:
                    raise ClientGone from None
                self.tail = chunk[-2:]
                self.last = (self.last + chunk)[-_USAGE_TAIL_BYTES:]


class _Cut(Exception):
    """The router ends a silent stream; the message says why (sent in the SSE error)."""


# why a request still running when the shutdown drain ran out was ended
DRAINED = "the router shut down before the answer was complete (drain_timeout_s)"


class _Drained(Exception):
    """The router's shutdown drain ran out while the stream was relayed."""


class _EndedEarly(Exception):
    """The backend closed its stream cleanly without ``[DONE]``: the answer is cut, and a
    client (the OpenAI SDKs stop reading at the end quietly) must be told."""


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


def _stream_usage(tail: bytes) -> Any:
    """The ``usage`` of the stream's usage chunk (``stream_options.include_usage``, asked
    by the client), found in the stream's last bytes. SSE lines may end with LF, CRLF or
    CR (the assembler reads LF and CRLF only: no engine sends bare CR), and ``data:``
    may go without its space."""
    if b'"prompt_tokens"' not in tail:
        return None
    if b"\r" in tail:
        tail = tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for event in reversed(tail.split(b"\n\n")):
        if b'"prompt_tokens"' in event and event.startswith(b"data:"):
            try:
                return _decode_usage(event[5:])
            except msgspec.DecodeError:
                return None
    return None


class ClientGone(Exception):
    """Writing to the client failed: it disconnected (not a backend failure)."""


def error_note(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object of the SSE error event sent after the first byte."""
    if isinstance(exc, _Cut):  # the codes of the answers before the first byte
        return {"message": str(exc), "type": "api_error", "code": BackendTimeout.code}
    if isinstance(exc, _Drained):
        return {"message": str(exc), "type": "api_error", "code": NoHealthyBackend.code}
    if isinstance(exc, _EndedEarly):
        return {"message": str(exc), "type": "api_error", "code": BackendFailed.code}
    msg = f"backend failed mid-stream: {type(exc).__name__}"
    return {"message": msg, "type": "api_error", "code": BackendFailed.code}


async def _write_sse_error(out: web.StreamResponse, exc: BaseException, tail: bytes) -> None:
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    event = sep + b"data: " + _encode({"error": error_note(exc)}) + b"\n\ndata: [DONE]\n\n"
    await _write_last(out, event)


async def _write_done(out: web.StreamResponse, tail: bytes) -> None:
    await _write_last(out, (b"" if tail.endswith(b"\n\n") else b"\n\n") + b"data: [DONE]\n\n")


async def _write_last(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
        await out.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass  # the client left too; nothing more to tell it


def _ends_with_error(tail: bytes) -> bool:
    """Whether the stream's last event is an error event (``data: {"error": ...}``)."""
    events = tail.replace(b"\r\n", b"\n").rstrip().split(b"\n\n")
    last = events[-1].removeprefix(b"data:").lstrip()
    return last.startswith(b'{"error"')
