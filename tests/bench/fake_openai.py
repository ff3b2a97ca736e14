"""A tiny fake OpenAI streaming server with two fake backends behind one port.

Requests alternate between backends "<base>/b0" and "<base>/b1" (named in the
x-kvroute-backend header, as a router would); each backend keeps vLLM-style prefix-cache
counters, served at "<base>/bN/metrics", with a toy cache: a prompt whose first word run
(up to 8 words) was seen on that backend before counts as fully cached.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvroute.bench.spec import count_tokens


@dataclass
class FakeBackend:
    queries: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    seen: set[str] = field(default_factory=set)

    def metrics(self) -> str:
        return (
            "# HELP vllm:prefix_cache_queries Prefix cache queries.\n"
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake"}} {self.queries}.0\n'
            "# HELP vllm:prefix_cache_hits Prefix cache hits.\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake"}} {self.hits}.0\n'
            "# HELP vllm:prompt_tokens Prompt tokens.\n"
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{engine="0",model_name="fake"}} {self.prompt_tokens}.0\n'
        )


@dataclass
class FakeState:
    backends: list[FakeBackend] = field(default_factory=lambda: [FakeBackend(), FakeBackend()])
    bodies: list[dict[str, Any]] = field(default_factory=list)
    send_times: list[float] = field(default_factory=list)
    fail_every: int = 0  # every Nth request answers 503 (0: never)
    token_delay_s: float = 0.001


STATE = web.AppKey("state", FakeState)


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(m["content"] for m in body["messages"])
    return body["prompt"]


async def _generate(request: web.Request) -> web.StreamResponse:
    state: FakeState = request.app[STATE]
    body = await request.json()
    state.bodies.append(body)
    state.send_times.append(time.perf_counter())
    n = len(state.bodies)
    if state.fail_every and n % state.fail_every == 0:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)
    index = n % len(state.backends)
    backend = state.backends[index]
    prompt = _prompt(body)
    num_prompt = count_tokens(prompt)
    key = " ".join(prompt.split(" ")[:8])
    cached = num_prompt if key in backend.seen else 0
    backend.seen.add(key)
    backend.queries += num_prompt
    backend.hits += cached
    backend.prompt_tokens += num_prompt
    base = f"http://{request.host}"
    resp = web.StreamResponse(headers={"x-kvroute-backend": f"{base}/b{index}"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    chat = "messages" in body
    if chat:  # vLLM sends the role first, with empty content
        await _send(
            resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        )
    for _i in range(body["max_tokens"]):
        await asyncio.sleep(state.token_delay_s)
        choice = (
            {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
        )
        await _send(resp, {"choices": [choice]})
    usage = {
        "prompt_tokens": num_prompt,
        "completion_tokens": body["max_tokens"],
        "total_tokens": num_prompt + body["max_tokens"],
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if body.get("stream_options", {}).get("include_usage"):
        await _send(resp, {"choices": [], "usage": usage})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def _metrics(request: web.Request) -> web.Response:
    state: FakeState = request.app[STATE]
    index = int(request.match_info["index"])
    return web.Response(text=state.backends[index].metrics(), content_type="text/plain")


def make_fake_app(state: FakeState) -> web.Application:
    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/b{index}/metrics", _metrics)
    return app
