"""The completion handlers: parse once, route via the Fleet, forward, relay, release.

Per request: admit the client key -> read and parse the body -> routing keys -> Fleet
decision -> dispatch (load acquired) -> open upstream -> relay (non-streaming: whole
body; streaming: each chunk as it arrives) -> Fleet.finish in a ``finally`` (load
released exactly once).

A non-streaming request to a vLLM engine (its model card says ``owned_by: vllm``) goes
upstream as a stream and comes back as one assembled body (router/assemble.py), so its
first token is seen as a streaming request's is (``assemble_non_streaming``). Requests
it cannot be done for faithfully (``assembly_blocker``), and other engines (their stream
format and stream options are not known to match), get the original bytes.

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
import os
import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from aiohttp import web

from kvroute.common.hashing import chain_seed
from kvroute.core.keys import Prompt, PromptError, prompt_block_hashes, salt_of, text_route_keys
from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision, RouteRequest
from kvroute.core.sessions import session_result
from kvroute.core.token_keys import PromptTokenizer, exact_route_keys, prompt_token_ids
from kvroute.router.assemble import assembly_blocker, stream_body
from kvroute.router.clients import client_address, is_trusted
from kvroute.router.config import SessionConfig
from kvroute.router.errors import (
    BadRequest,
    KvrouteError,
    ModelNotFound,
    NoHealthyBackend,
    PayloadTooLarge,
)
from kvroute.router.relay import AnswerPlan, relay
from kvroute.router.request import parse_completion_body
from kvroute.router.state import BUILTIN_TOKENIZER, NOTE, STATE, RouterState
from kvroute.router.upstream import AttemptFailed, Deadline, open_upstream

log = logging.getLogger("kvroute.router.requests")
CHAT_PATH = "/v1/chat/completions"
# below this body size a thread hop (~50-100 us) costs more than tokenizing in place
OFF_LOOP_MIN_BYTES = 8_192
# a body this big is parsed and keyed in a thread (built-in tokenizer or text keys), so
# the loop keeps answering meanwhile (a 4 MiB prompt: ~0.5 s of tokenizing). Pure Python
# holds the GIL, but the loop gets it back every 5 ms (sys.getswitchinterval; the
# tokenizer's regex runs in slices for that), so below ~3 ms of work (64 KiB of text) a
# thread would give nothing back
OFF_LOOP_KEYS_BYTES = 65_536
COMPLETIONS_PATH = "/v1/completions"
# backends one body may reach: the first, and one more after a 503 (connect errors do
# not count: nothing was sent)
MAX_DELIVERIES = 2
# engines (a model card's "owned_by") whose stream is assembled for non-streaming clients:
# their chunks and whole answers were checked to match (vLLM, and the simulator)
ASSEMBLE_OWNERS = frozenset({"vllm"})
# a session hint longer than this, or with a control character, is no hint (not an error)
MAX_SESSION_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def new_request_id() -> str:
    return os.urandom(12).hex()


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _handle(request, CHAT_PATH, chat=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, COMPLETIONS_PATH, chat=False)


async def _handle(request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if state.shutting_down:
        raise NoHealthyBackend("router is shutting down")
    admitted = state.gate.admit(request.headers.get("Authorization"))
    state.num_in_flight += 1
    try:
        raw = await _read_body(request, state.config.limits.max_body_bytes)
        t0 = state.clock()
        route_req, stream, body, text_bytes = await _route_request(state, request, raw, chat=chat)
        state.metrics.decision.observe(state.clock() - t0)
        upstream = _Upstream(raw, body, chat, stream, state.config.assemble_non_streaming)
        upstream.text_bytes = text_bytes
        return await _forward(state, request, route_req, upstream, path)
    except asyncio.CancelledError:
        state.metrics.client_disconnects.inc()  # aiohttp cancels a handler on disconnect
        raise
    finally:
        state.num_in_flight -= 1
        state.gate.release(admitted)


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"request body of {length} bytes exceeds the {limit}-byte limit")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit") from None


async def _route_request(
    state: RouterState, request: web.Request, raw: bytes, *, chat: bool
) -> tuple[RouteRequest, bool, dict[str, Any], int | None]:
    """(what the Fleet routes on, whether the client asked for a stream, the body, the
    UTF-8 bytes of the one text prompt keyed as text: None for token keys or a batch)."""
    name_chars = state.config.limits.max_model_name_chars
    if len(raw) >= OFF_LOOP_KEYS_BYTES:
        parsed, body = await asyncio.to_thread(
            parse_completion_body, raw, chat=chat, max_model_name_chars=name_chars
        )
    else:
        parsed, body = parse_completion_body(raw, chat=chat, max_model_name_chars=name_chars)
    model = parsed.model
    if model is None:
        model = state.backends.only_model()
        if model is None and len(state.backends.model_cards()) > 1:
            raise BadRequest("'model' is required: this router serves several models")
    elif not state.backends.model_is_known(model):
        raise ModelNotFound(f"the model '{model}' does not exist on any backend")
    state.backends.check_context(model, parsed)
    # the engine gets an id of ours (vLLM may use it as its own request id: two clients
    # must not collide); the client's own id stays in its answer's header and our logs
    rid = new_request_id()
    request[NOTE].request_id = request.headers.get("x-request-id") or rid
    if state.config.log_prompts:  # off by default: prompts are private
        client = client_address(
            request.remote, request.headers.get("X-Forwarded-For"), state.config.trusted_proxies
        )
        log.info(
            "request %s (upstream %s) from %s model %s prompt %r",
            request[NOTE].request_id, rid, client, model, parsed.prompt,
        )  # fmt: skip
    hashes, num_tokens, text_bytes = await _route_keys(
        state, model, parsed.prompt, body, chat, len(raw)
    )
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and type(prompt[0]) is not int:
        text_bytes = None  # a batch: the usage counts every prompt, the keys only the first
    route_req = RouteRequest(
        request_id=rid,
        model=model,
        block_hashes=hashes,
        num_prompt_tokens=num_tokens,
        max_tokens=parsed.max_tokens,
        session=session_hint(request.headers, body, state.config.sessions),
    )
    return route_req, parsed.stream, body, text_bytes


def session_hint(
    headers: Mapping[str, str], body: Mapping[str, Any], config: SessionConfig
) -> str | None:
    """The request's session: the first configured header with a usable value, else the
    body's ``user`` string (if configured); None without one. Unusable (empty, over
    MAX_SESSION_CHARS, a control character) counts as absent: a hint is never refused."""
    for name in config.headers:
        value = headers.get(name)
        if value is not None and _usable(value):
            return value
    user = body.get("user") if config.use_user_field else None
    return user if isinstance(user, str) and _usable(user) else None


def _usable(value: str) -> bool:
    return 0 < len(value) <= MAX_SESSION_CHARS and _CONTROL.search(value) is None


async def _route_keys(
    state: RouterState,
    model: str | None,
    prompt: Prompt,
    body: dict[str, Any],
    chat: bool,
    body_bytes: int,
) -> tuple[list[int], int, int | None]:
    """(block keys, prompt tokens, text bytes): the engine's token ids while the model is
    routed on KV events (exact keys), else text keys and a token estimate from the text's
    UTF-8 bytes (learned per model: Fleet.prompt_tokens_estimate). Long bodies are keyed
    in a thread: a real model's tokenizer above OFF_LOOP_MIN_BYTES (Rust that releases
    the GIL), the built-in one and text keys above OFF_LOOP_KEYS_BYTES."""
    fleet = state.fleet
    bs = fleet.block_size_for(model)
    # a salted request shares cache only with its salt, an adapter's only with itself
    lora = model if model is not None and model in state.backends.adapters else None
    seed = chain_seed(salt_of(body), lora)
    off_loop = body_bytes >= OFF_LOOP_KEYS_BYTES
    work: Callable[[], tuple[list[int], int]]
    if fleet.key_kind_for(model) != "tokens":
        hashes, size = await _keys_work(partial(_text_keys, prompt, bs, seed), off_loop)
        if prompt.text is None:
            return hashes, size, None  # token ids: their count is exact
        return hashes, fleet.prompt_tokens_estimate(model, size), size
    tokenizer = state.tokenizer_for(model)
    if tokenizer is BUILTIN_TOKENIZER:
        work = partial(_builtin_keys, prompt, bs, seed)  # the body is parsed already
    else:
        work = partial(_tokenizer_keys, tokenizer, body, chat, bs, seed)
        off_loop = tokenizer.off_loop and body_bytes >= OFF_LOOP_MIN_BYTES
    hashes, num_tokens = await _keys_work(work, off_loop)
    return hashes, num_tokens, None


async def _keys_work(
    work: Callable[[], tuple[list[int], int]], off_loop: bool
) -> tuple[list[int], int]:
    try:
        return await asyncio.to_thread(work) if off_loop else work()
    except PromptError as exc:
        raise BadRequest(str(exc)) from None


def _text_keys(prompt: Prompt, bs: int, seed: int) -> tuple[list[int], int]:
    """(keys, UTF-8 bytes of the text); for token ids, (their keys, their count)."""
    if prompt.text is None:
        return prompt_block_hashes(prompt, bs, seed), prompt.num_tokens_estimate
    return text_route_keys(prompt.text, bs, seed)


def _builtin_keys(prompt: Prompt, bs: int, seed: int) -> tuple[list[int], int]:
    return exact_route_keys(prompt_token_ids(prompt), bs, seed)


def _tokenizer_keys(
    tokenizer: PromptTokenizer, body: dict[str, Any], chat: bool, bs: int, seed: int
) -> tuple[list[int], int]:
    return exact_route_keys(tokenizer.token_ids(body, chat), bs, seed)


class _Upstream:
    """What goes upstream for one request: the client's bytes, or (assembled) the same
    body asking for a stream, encoded once on first use."""

    __slots__ = ("_stream_raw", "blocker", "body", "chat", "raw", "stream", "text_bytes")

    def __init__(
        self, raw: bytes, body: dict[str, Any], chat: bool, stream: bool, assemble: bool
    ) -> None:
        self.raw, self.body, self.chat, self.stream = raw, body, chat, stream
        # why this request is not assembled (None: it is, on a vLLM backend)
        self.blocker = "disabled" if not assemble else None
        if stream:
            self.blocker = "stream"
        elif self.blocker is None:
            self.blocker = assembly_blocker(body, chat)
        self._stream_raw: bytes | None = None
        self.text_bytes: int | None = None  # of the one text prompt keyed (calibration)

    async def for_backend(self, state: RouterState, url: str, model: str | None) -> tuple[
        AnswerPlan, bytes
    ]:  # fmt: skip
        """(how the answer is relayed, the bytes to send) for one attempt on ``url``."""
        if self.blocker is not None or not _speaks_vllm(state, url, model):
            return AnswerPlan(False, self.chat, model, self.text_bytes), self.raw
        if self._stream_raw is None:
            if len(self.raw) >= OFF_LOOP_KEYS_BYTES:
                self._stream_raw = await asyncio.to_thread(stream_body, self.body)
            else:
                self._stream_raw = stream_body(self.body)
        return AnswerPlan(True, self.chat, model, self.text_bytes), self._stream_raw


def _speaks_vllm(state: RouterState, url: str, model: str | None) -> bool:
    """``url`` lists ``model`` on a card of an engine whose stream we assemble."""
    rt = state.backends.get(url)
    card = rt.model_cards.get(model) if rt is not None and model is not None else None
    return card is not None and card.get("owned_by") in ASSEMBLE_OWNERS


def _upstream_headers(
    state: RouterState, request: web.Request, url: str, rid: str, plan: AnswerPlan
) -> dict[str, str]:
    h = request.headers
    headers = {
        "Content-Type": "application/json",
        "x-request-id": rid,
        "Accept-Encoding": h.get("Accept-Encoding", "identity"),
    }
    if plan.assembled:  # the router reads this stream: plain SSE
        headers["Accept-Encoding"] = "identity"
        headers["Accept"] = "text/event-stream"
    rt = state.backends.get(url)
    auth = rt.auth_header if rt is not None else None
    if auth is None and not state.gate.require_key:
        auth = h.get("Authorization")  # no router keys: the client's key is the backend's
    if auth:
        headers["Authorization"] = auth
    accept = h.get("Accept")
    if accept and not plan.assembled:
        headers["Accept"] = accept
    peer = request.remote
    if peer:
        # a client's own X-Forwarded-For is dropped unless it came through a trusted proxy
        trusted = state.config.trusted_proxies
        xff = h.get("X-Forwarded-For") if trusted and is_trusted(peer, trusted) else None
        headers["X-Forwarded-For"] = f"{xff}, {peer}" if xff else peer
    return headers


async def _forward(
    state: RouterState, request: web.Request, req: RouteRequest, upstream: _Upstream, path: str
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
        if req.session is not None and len(tried) == 1:  # the placement, not its retries
            state.metrics.count_session(session_result(home, url))
        ok = False
        try:
            # a stream's headers come at once; a whole answer only when it is generated
            if stream:
                answer = _sooner(total, loop.time(), timeouts.first_byte_s, "first_byte_s")
            else:
                answer = _sooner(total, loop.time(), timeouts.response_s, "response_s")
            plan, data = await upstream.for_backend(state, url, req.model)
            headers = _upstream_headers(state, request, url, req.request_id, plan)
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
    return None if decision is None else dataclasses.replace(decision, reason="retry")


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
        return NoHealthyBackend(f"no healthy backend can serve {what}")
    err = last.to_client_error()
    if len(tried) > 1:
        err.message = f"{len(tried)} backends tried; last: {err.message}"
        err.args = (err.message,)
    return err
