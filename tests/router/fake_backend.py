"""A tiny OpenAI-compatible backend for router tests, with switchable faults.

Answers are a deterministic function of the request body, so "through the router" and
"direct" can be compared byte for byte. Faults: answer a status (``fail_status``), stall
before the headers (``stall_s``), cut the connection after N stream chunks
(``die_after_chunks``). It counts requests and streams aborted by the client side.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class FakeState:
    name: str
    model: str = "m1"
    adapters: tuple[str, ...] = ()  # LoRA adapters of ``model`` it also serves
    max_model_len: int | None = None  # listed on its model card when set (as vLLM does)
    fail_status: int | None = None  # answer completions with this status
    health_status: int = 200
    stall_s: float = 0.0  # sleep before answering
    die_after_chunks: int | None = None  # drop the connection after this many chunks
    chunk_delay_s: float = 0.0
    num_chunks: int = 4
    metrics_text: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)  # headers + body
    num_aborted: int = 0  # streams whose client (the router) went away
    num_active: int = 0


def answer(state: FakeState, body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt") or json.dumps(body.get("messages"))
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": state.model,
        "choices": [{"index": 0, "text": f"echo:{prompt}"[:64], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def make_fake_app(state: FakeState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        state.requests.append({"headers": request.headers.copy(), "body": raw})
        state.num_active += 1
        try:
            if state.stall_s:
                await asyncio.sleep(state.stall_s)
            if state.fail_status is not None:
                return web.json_response(
                    {"error": {"message": "fault", "type": "x", "code": state.fail_status}},
                    status=state.fail_status,
                )
            if body.get("model") not in (None, state.model, *state.adapters):
                return web.json_response({"error": {"message": "no such model"}}, status=404)
            if not body.get("stream"):
                return web.json_response(answer(state, body), headers={"x-backend": state.name})
            return await _stream(request, state)
        finally:
            state.num_active -= 1

    async def _stream(request: web.Request, state: FakeState) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(state.num_chunks):
                if state.die_after_chunks is not None and i >= state.die_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if state.chunk_delay_s:
                    await asyncio.sleep(state.chunk_delay_s)
                await resp.write(f'data: {{"i": {i}, "from": "{state.name}"}}\n\n'.encode())
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionError):
            state.num_aborted += 1
            raise
        return resp

    async def models(request: web.Request) -> web.Response:
        cards: list[dict[str, Any]] = [{"id": state.model, "object": "model", "parent": None}]
        if state.max_model_len is not None:
            cards[0]["max_model_len"] = state.max_model_len
        cards += [{"id": a, "object": "model", "parent": state.model} for a in state.adapters]
        return web.json_response({"object": "list", "data": cards})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=state.health_status)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=state.metrics_text)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class FakeBackend:
    """One running fake backend on loopback."""

    def __init__(self, name: str, model: str = "m1") -> None:
        self.state = FakeState(name=name, model=model)
        self.server = TestServer(make_fake_app(self.state), host="127.0.0.1")
        self.url = ""  # set by start()

    async def start(self) -> FakeBackend:
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self

    async def close(self) -> None:
        await self.server.close()
