"""What each attempt sends upstream: the body's bytes and the request's headers.

A non-streaming request to a vLLM engine (its model card says ``owned_by: vllm``) goes
upstream as a stream and comes back as one assembled body (router/assemble.py), so its
first token is seen as a streaming request's is (``assemble_non_streaming``). Requests
it cannot be done for faithfully (``assembly_blocker``), and other engines (their stream
format and stream options are not known to match), get the original bytes. The headers
ask for no content coding (the router reads the answer) and carry the router's request
id, the backend's key (or, with no router keys, the client's), the client's address in
X-Forwarded-For, and of the client's own headers only those an engine may use and that
carry no secret of the router's: Accept, User-Agent and the W3C trace context.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kvroute.router.assemble import assembly_blocker, stream_body
from kvroute.router.clients import is_trusted
from kvroute.router.relay import AnswerPlan
from kvroute.router.route_request import OFF_LOOP_KEYS_BYTES
from kvroute.router.state import RouterState
from kvroute.router.upstream import connection_tokens

# engines (a model card's "owned_by") whose stream is assembled for non-streaming clients:
# their chunks and whole answers were checked to match (vLLM, and the simulator)
ASSEMBLE_OWNERS = frozenset({"vllm"})

# client headers sent on as they came: what the engine's logs and traces join on (vLLM
# and SGLang export OpenTelemetry spans under the caller's traceparent)
FORWARDED_HEADERS = ("User-Agent", "traceparent", "tracestate", "baggage")


class OutboundBody:
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


def outbound_headers(
    state: RouterState, request: web.Request, url: str, rid: str, plan: AnswerPlan
) -> dict[str, str]:
    """The headers of one attempt on ``url`` for request id ``rid`` (module doc)."""
    h = request.headers
    hop = connection_tokens(h)  # the client's hop-by-hop fields: not passed on
    headers = {
        "Content-Type": "application/json",
        "x-request-id": rid,
        # the router reads every answer (usage, [DONE], errors) and may end a stream with
        # its own event: an engine's gzip would hide the first and be corrupted by the last
        "Accept-Encoding": "identity",
    }
    if plan.assembled:  # the router reads this stream as SSE
        headers["Accept"] = "text/event-stream"
    rt = state.backends.get(url)
    auth = rt.auth_header if rt is not None else None
    if auth is None and not state.gate.require_key and "authorization" not in hop:
        auth = h.get("Authorization")  # no router keys: the client's key is the backend's
    if auth:
        headers["Authorization"] = auth
    accept = h.get("Accept") if "accept" not in hop else None
    if accept and not plan.assembled:
        headers["Accept"] = accept
    for name in FORWARDED_HEADERS:
        value = h.get(name)
        if value is not None and name.lower() not in hop:
            headers[name] = value
    peer = request.remote
    if peer:
        # a client's own X-Forwarded-For is dropped unless it came through a trusted proxy
        trusted = state.config.trusted_proxies
        xff = h.get("X-Forwarded-For") if trusted and is_trusted(peer, trusted) else None
        headers["X-Forwarded-For"] = f"{xff}, {peer}" if xff else peer
    return headers
