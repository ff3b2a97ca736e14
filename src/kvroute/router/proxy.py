"""The completion handlers: parse once, route via the Fleet, forward, relay, release.

Per request: admit the client key -> read the body -> what the Fleet routes on (parse,
routing keys: router/route_request.py) -> Fleet decision -> dispatch (load acquired) ->
open upstream with the attempt's body and headers (router/outbound.py) -> relay
(non-streaming: whole body; streaming: each chunk as it arrives) -> Fleet.finish in a
``finally`` (load released exactly once).

Only a backend that could not take the request (connect error, 503) is retried, on the
next eligible backend of the decision's ranking (``_retry_decision``), and a body reaches
at most ``MAX_DELIVERIES`` backends: whatever else fails (another 5xx, a reset, a slow
answer) may be this body's doing, so it is answered 502/504 at once rather than run
again elsewhere. After the first byte nothing is retried: a broken stream ends with an
SSE error event.

Each attempt whose decision carried the cost model's TTFT estimate and whose first token
was seen is counted against it (``kvroute_ttft_prediction_error_seconds``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

from aiohttp import web

from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision, RouteRequest
from kvroute.core.sessions import session_result
from kvroute.router.body import read_body
from kvroute.router.errors import KvrouteError, NoHealthyBackend
from kvroute.router.outbound import OutboundBody, outbound_headers
from kvroute.router.relay import DRAINED, relay
from kvroute.router.route_request import route_request
from kvroute.router.state import NOTE, STATE, RouterState
from kvroute.router.upstream import AttemptFailed, Deadline, open_upstream

log = logging.getLogger("kvroute.router.requests")
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# backends one body may reach: the first, and one more after a 503 (connect errors do
# not count: nothing was sent)
MAX_DELIVERIES = 2


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _handle(request, CHAT_PATH, chat=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, COMPLETIONS_PATH, chat=False)


async def _handle(request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if state.shutting_down:
        raise NoHealthyBackend("router is shutting down")
    admitted = state.gate.admit(request.headers.get("Authorization"))
    task = asyncio.current_task()
    assert task is not None, "aiohttp runs each handler in a task"
    state.handlers.add(task)
    try:
        raw = await read_body(request, state.config.limits.max_body_bytes)
        t0 = state.clock()
        route_req, stream, body, text_bytes = await route_request(state, request, raw, chat=chat)
        state.metrics.decision.observe(state.clock() - t0)
        upstream = OutboundBody(raw, body, chat, stream, state.config.assemble_non_streaming)
        upstream.text_bytes = text_bytes
        return await _forward(state, request, route_req, upstream, path)
    except asyncio.CancelledError:
        if state.drain_expired:  # cut by the drain, not the client
            task.uncancel()
            raise NoHealthyBackend(DRAINED) from None
        state.metrics.client_disconnects.inc()  # aiohttp cancels a handler on disconnect
        raise
    finally:
        state.handlers.discard(task)
        state.gate.release(admitted)


async def _forward(
    state: RouterState, request: web.Request, req: RouteRequest, upstream: OutboundBody, path: str
) -> web.StreamResponse:
    """Send the body to the best backend; to the next only if one refused it."""
    stream = upstream.stream
    fleet, clock, limits = state.fleet, state.clock, state.config.limits
    timeouts = state.config.timeouts
    loop = asyncio.get_running_loop()
    total = Deadline(loop.time() + timeouts.total_s, timeouts.total_s, "timeouts.total_s")
    tried: list[str] = []
    num_delivered = 0
    last: AttemptFailed | None = None
    # where the session's last request went, before this one's dispatch replaces it
    home = fleet.session_backend(req, clock()) if req.session is not None else None
    first: Decision | None = None  # the policy's decision: retries walk its ranking
    for attempt in range(limits.max_attempts):
        if last is not None and not (last.refused and num_delivered < MAX_DELIVERIES):
            break
        if first is None:
            decision = first = fleet.route(req, clock())
        else:
            decision = _retry_decision(state, req, first, tried)
        if decision is None:
            break
        if last is not None:
            state.metrics.retries.labels(tried[-1], last.cause).inc()
            await asyncio.sleep(limits.retry_backoff_s * attempt)
        url = decision.backend
        tried.append(url)
        ticket = fleet.dispatch(decision, req, clock())
        state.backends.begin_attempt(url)
        _count_prediction(state, decision.backend, ticket.predicted_cached_tokens, req)
        if len(tried) == 1:  # the placement, not its retries
            if req.session is not None:
                state.metrics.count_session(session_result(home, url))
            if decision.left_cached_tokens:
                state.metrics.left_cached.inc(decision.left_cached_tokens)
        ok = False
        try:
            # a stream's headers come at once; a whole answer only when it is generated
            if stream:
                answer = _sooner(total, loop.time(), timeouts.first_byte_s, "first_byte_s")
            else:
                answer = _sooner(total, loop.time(), timeouts.response_s, "response_s")
            plan, data = await upstream.for_backend(state, url, req.model)
            headers = outbound_headers(state, request, url, req.request_id, plan)
            if log.isEnabledFor(logging.DEBUG):
                client_rid = request[NOTE].request_id
                log.debug("request %s (upstream %s) -> %s", client_rid, req.request_id, url)
            try:
                resp = await open_upstream(state.session, url + path, data, headers, answer)
            except AttemptFailed as exc:
                last = exc
                num_delivered += exc.delivered
                if exc.refused:  # the backend said it cannot work: that is its state
                    state.backends.record_failure(url, str(exc))
                continue
            state.backends.record_success(url)
            note = request[NOTE]
            note.backend, note.reason = url, decision.reason
            body_deadline = total if stream else answer
            ok, response = await relay(state, request, resp, ticket, decision, body_deadline, plan)
            return response
        except asyncio.CancelledError:
            ok = True  # the client went away; the backend did not fail
            raise
        finally:
            state.backends.end_attempt(url)
            fleet.finish(ticket, clock(), ok)
            _count_ttft_error(state, ticket, decision)
    raise _final_error(state, req, tried, last)


def _sooner(total: Deadline, now: float, seconds: float, name: str) -> Deadline:
    """The deadline ``seconds`` from now (``timeouts.<name>``), or ``total`` if sooner."""
    own = Deadline(now + seconds, seconds, f"timeouts.{name}")
    return own if own.at < total.at else total


def _retry_decision(
    state: RouterState, req: RouteRequest, first: Decision, tried: list[str]
) -> Decision | None:
    """Where a retry goes: the next backend of ``first``'s ranking not tried yet and still
    eligible (one may have gone down or been drained since), re-aimed with ``moved_to``:
    the policy ranked them once, a retry does not decide again. Only once the ranking is
    spent is the request routed again without the backends tried: a ranking is capped
    (8 backends by default, ``ranked_limit``) and so may be shorter than the fleet."""
    fleet = state.fleet
    for url in first.ranked:
        if url not in tried and fleet.is_eligible(url, req.model):
            return first.moved_to(url)
    decision = fleet.route(req, state.clock(), exclude=tuple(tried))
    if decision is None:
        return None
    return dataclasses.replace(decision, reason="retry", left_cached_tokens=0)


def _count_ttft_error(state: RouterState, ticket: Ticket, decision: Decision) -> None:
    """Compare the TTFT the decision estimated with the one observed: dispatch to first
    token on the Fleet's clock, the span the cost model estimates. Only attempts with
    both: a whole answer (not assembled) has no first token, and a ranked retry or a
    policy that does not use the cost model carries no estimate."""
    predicted, first_token_at = decision.ttft_estimate_s, ticket.first_token_at_s
    if predicted is None or first_token_at is None:
        return
    observed = first_token_at - ticket.dispatched_at_s
    state.metrics.count_ttft_prediction(ticket.url, predicted, observed)


def _count_prediction(state: RouterState, url: str, cached: int, req: RouteRequest) -> None:
    inst = state.metrics.of(url)
    inst.predicted_cached.inc(cached)
    inst.prompt_tokens.inc(req.num_prompt_tokens)


def _final_error(
    state: RouterState, req: RouteRequest, tried: list[str], last: AttemptFailed | None
) -> KvrouteError:
    if last is None:
        what = f"model '{req.model}'" if req.model else "this request"
        # a backend comes back at a health probe: that is when trying again makes sense
        after = str(min(60, max(1, math.ceil(state.config.health.interval_s))))
        return NoHealthyBackend(
            f"no healthy backend can serve {what}", headers={"Retry-After": after}
        )
    err = last.to_client_error()
    if len(tried) > 1:
        err.message = f"{len(tried)} backends tried; last: {err.message}"
        err.args = (err.message,)
    return err
