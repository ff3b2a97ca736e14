"""A vLLM-like scripted backend for the stream-assisted relay tests (issue 10).

Its model card says ``owned_by: vllm``, so the router asks it for a stream whenever a
client does not; it answers a stream request with the scripted SSE events (optionally
holding the first one, or the rest, until the test lets it go, or dropping the
connection) and a non-streaming one with the scripted whole answer.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


def sse(*events: dict[str, Any] | str) -> list[bytes]:
    return [
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    ]


def text_stream(pieces: list[str], usage: dict[str, Any], chat: bool) -> list[bytes]:
    """A vLLM-shaped stream of ``pieces`` (chat: a role chunk first) ending with usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    top = {"id": "x-1", "object": obj, "created": 1, "model": "m1"}
    chunks: list[dict[str, Any]] = []
    if chat:
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunks.append({**top, "choices": [role]})
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        chunks.append({**top, "choices": [choice]})
    return sse(*chunks, {**top, "choices": [], "usage": usage}, "[DONE]")


@dataclass
class VllmScript:
    events: list[bytes] = field(default_factory=list)  # answer to a stream request
    whole: dict[str, Any] = field(default_factory=dict)  # answer to a non-streaming one
    status: int | None = None  # answer every completion with this JSON error instead
    hold_first: asyncio.Event | None = None  # wait for it before the first event
    hold_rest: asyncio.Event | None = None  # wait for it after the first event
    drop_after: int | None = None  # close the connection after this many events
    gap_s: float = 0.0  # pause before each event
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    owned_by: str = "vllm"
    # set: answers count ceil(prompt bytes / this) prompt tokens (completions), and the
    # events and whole answer are built per request with that usage
    bytes_per_token: float | None = None
    metrics_text: str = ""


class VllmLike:
    def __init__(self) -> None:
        self.script = VllmScript()
        self.server = TestServer(self._app(), host="127.0.0.1")
        self.url = ""

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", _ok)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": "m1", "object": "model", "owned_by": self.script.owned_by}
        return web.json_response({"object": "list", "data": [card]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        s = self.script
        raw = await request.read()
        s.bodies.append(raw)
        s.headers.append({k.lower(): v for k, v in request.headers.items()})
        if s.status is not None:
            error = {
                "object": "error",
                "message": "refused",
                "type": "BadRequestError",
                "param": None,
                "code": s.status,
            }
            return web.json_response(error, status=s.status)
        body = json.loads(raw)
        if s.bytes_per_token is not None:
            self._answer_like_a_tokenizer(body)
        if not body.get("stream"):
            if s.gap_s:
                await asyncio.sleep(s.gap_s)
            return web.json_response(s.whole)
        # spelled as uvicorn (vLLM's server) sends it
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i, event in enumerate(s.events):
            if i == 0 and s.hold_first is not None:
                await s.hold_first.wait()
            if i == 1 and s.hold_rest is not None:
                await s.hold_rest.wait()
            if s.drop_after is not None and i >= s.drop_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            if s.gap_s:
                await asyncio.sleep(s.gap_s)
            await resp.write(event)
        await resp.write_eof()
        return resp

    def _answer_like_a_tokenizer(self, body: dict[str, Any]) -> None:
        s = self.script
        assert s.bytes_per_token is not None
        n = math.ceil(len(body["prompt"].encode()) / s.bytes_per_token)
        usage = {
            "prompt_tokens": n,
            "total_tokens": n + 2,
            "completion_tokens": 2,
            "prompt_tokens_details": None,
        }
        include = (body.get("stream_options") or {}).get("include_usage")
        s.events = text_stream(["a", "b"], usage, chat=False)
        if not include:
            s.events = s.events[:-2] + s.events[-1:]  # no usage chunk
        s.whole = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m1",
            "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}],
            "usage": usage,
        }

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.script.metrics_text)

    async def start(self) -> VllmLike:
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self

    async def close(self) -> None:
        for gate in (self.script.hold_first, self.script.hold_rest):
            if gate is not None:
                gate.set()
        await self.server.close()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(status=200)
