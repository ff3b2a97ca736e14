"""A fake OpenAI-compatible backend: deterministic answers, switchable faults.

The one stand-in for an engine where the engine itself is not the point: the router's
and the load generator's tests (in-process, on loopback), and the benchmarks of the
router's own cost, which run it as a process:

    python -m kvroute.bench.fake_backend PORT      # canned answers for almost no CPU

Answers (``make_fake_app``):

- whole answers echo the prompt (``echo:<prompt>``, cut to 64 characters); usage counts
  3 prompt and 4 completion tokens unless the toy cache is on;
- streams are SSE chunks shaped as vLLM's (a chat stream starts with the role chunk),
  ``num_chunks`` of them (None: one per ``max_tokens``), each also carrying ``i`` and
  ``from`` (the backend's name) so a test sees who answered; a usage chunk when the
  client asked for ``stream_options.include_usage``; then ``[DONE]``;
- ``cache_words`` > 0 turns on a toy prefix cache: prompts count tokens as the built-in
  tokenizer does, and a prompt whose first ``cache_words`` words were seen before on the
  same backend is fully cached (``cached_tokens`` in the usage, vLLM's counters in
  ``/metrics``);
- ``virtual_backends`` > 1 answers as a router would: requests go round robin to that
  many backends named ``<base>/b<k>`` in ``x-kvroute-backend``, each with its own
  counters at ``/b<k>/metrics``.

Faults (fields of ``FakeState``, changeable while it runs): answer a status
(``fail_status``, or every ``fail_every``-th request 503), stall before answering
(``stall_s``) or never answer (``hang``), cut the connection after reading the body
(``reset``) or after some stream chunks (``die_after_chunks``), pause between chunks
(``chunk_delay_s``, or ``chunk_gaps_s`` one by one), answer a huge body (``big_bytes``),
fail ``/health`` (``health_status``). It records every request and counts the requests
its client abandoned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class CacheCounters:
    """vLLM's prefix-cache counters of one (virtual) backend, in tokens."""

    queries: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    seen: set[str] = field(default_factory=set)  # prompt heads cached so far

    def metrics(self, model: str) -> str:
        labels = f'{{engine="0",model_name="{model}"}}'
        lines = []
        for name, value in (
            ("prefix_cache_queries", self.queries),
            ("prefix_cache_hits", self.hits),
            ("prompt_tokens", self.prompt_tokens),
        ):
            lines += [f"# TYPE vllm:{name} counter", f"vllm:{name}_total{labels} {value}.0"]
        return "\n".join(lines) + "\n"


@dataclass
class FakeState:
    """What the fake answers and what it saw (module doc)."""

    name: str = "fake"  # "from" in stream chunks, x-backend on whole answers
    model: str = "m1"  # served model (other names get 404)
    adapters: tuple[str, ...] = ()  # LoRA adapters of ``model`` it also serves
    max_model_len: int | None = None  # listed on its model card when set (as vLLM does)
    num_chunks: int | None = 4  # stream chunks; None: one per max_tokens
    chunk_delay_s: float = 0.0  # pause before each stream chunk
    chunk_gaps_s: tuple[float, ...] = ()  # set: one chunk per entry, after that pause
    cache_words: int = 0  # > 0: the toy prefix cache keyed by this many leading words
    virtual_backends: int = 1  # > 1: answer as a router in front of that many backends
    fail_status: int | None = None  # answer completions with this status
    fail_retry_after: str | None = None  # ... and this Retry-After header
    fail_every: int = 0  # every Nth request answers 503 (0: never)
    reset: bool = False  # read the body, then drop the connection
    hang: bool = False  # never answer (until ``release`` is set: FakeBackend.close)
    stall_s: float = 0.0  # sleep before answering
    big_bytes: int = 0  # > 0: a whole answer of this many bytes (spaces) instead
    big_length: bool = True  # announce the big answer's length (else chunked)
    die_after_chunks: int | None = None  # drop the connection after this many chunks
    health_status: int = 200
    metrics_text: str = ""  # /metrics page; empty: the toy counters of backend 0
    counters: list[CacheCounters] = field(default_factory=list)  # one per virtual backend
    requests: list[dict[str, Any]] = field(default_factory=list)  # headers + raw body
    bodies: list[dict[str, Any]] = field(default_factory=list)  # parsed bodies
    send_times: list[float] = field(default_factory=list)  # perf_counter at arrival
    num_aborted: int = 0  # requests whose client went away before the answer's end
    num_active: int = 0  # requests being answered now

    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends hanging answers

    def __post_init__(self) -> None:
        if not self.counters:
            self.counters = [CacheCounters() for _ in range(self.virtual_backends)]


STATE = web.AppKey("state", FakeState)


def router_like_state(model: str = "fake-model") -> FakeState:
    """A fake router in front of two backends, as the load generator's tests use it: a
    stream chunk per output token (1 ms apart), the toy cache on, counters per backend."""
    return FakeState(
        name="fake", model=model, num_chunks=None, chunk_delay_s=0.001, cache_words=8,
        virtual_backends=2,
    )  # fmt: skip


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        messages = body["messages"]
        if all(isinstance(m.get("content"), str) for m in messages):
            return "\n".join(m["content"] for m in messages)
        return json.dumps(messages)
    return str(body.get("prompt"))


def _usage(state: FakeState, index: int, body: dict[str, Any]) -> dict[str, Any]:
    """Usage of this request; with the toy cache on, its counters move too."""
    if not state.cache_words:
        return {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    from kvroute.bench.spec import count_tokens  # the built-in tokenizer, only when used

    prompt = _prompt(body)
    num_prompt = count_tokens(prompt)
    counters = state.counters[index]
    key = " ".join(prompt.split(" ")[: state.cache_words])
    cached = num_prompt if key in counters.seen else 0
    counters.seen.add(key)
    counters.queries += num_prompt
    counters.hits += cached
    counters.prompt_tokens += num_prompt
    num_out = int(body.get("max_tokens") or 16)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_out,
        "total_tokens": num_prompt + num_out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await request.read()
    body = json.loads(raw)
    state.requests.append({"headers": request.headers.copy(), "body": raw})
    state.bodies.append(body)
    state.send_times.append(time.perf_counter())
    state.num_active += 1
    try:
        return await _answer(request, state, body)
    except (asyncio.CancelledError, ConnectionError):
        state.num_aborted += 1
        raise
    finally:
        state.num_active -= 1


async def _answer(
    request: web.Request, state: FakeState, body: dict[str, Any]
) -> web.StreamResponse:
    if state.stall_s:
        await asyncio.sleep(state.stall_s)
    n = len(state.bodies)
    if state.fail_status is not None:
        resp = _error(state.fail_status, f"engine says {state.fail_status}")
        if state.fail_retry_after is not None:
            resp.headers["Retry-After"] = state.fail_retry_after
        return resp
    if state.fail_every and n % state.fail_every == 0:
        return _error(503, "overloaded")
    if state.reset:
        assert request.transport is not None
        request.transport.close()
        return web.Response()
    if state.hang:
        await state.release.wait()
        return _error(500, "released")
    if state.big_bytes:
        return await _big(request, state)
    if body.get("model") not in (None, state.model, *state.adapters):
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    index = n % state.virtual_backends
    usage = _usage(state, index, body)
    headers = {"x-backend": state.name}
    if state.virtual_backends > 1:
        headers["x-kvroute-backend"] = f"http://{request.host}/b{index}"
    if not body.get("stream"):
        return web.json_response(_whole(state, body, usage), headers=headers)
    return await _stream(request, state, body, usage, headers)


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "fake", "code": status}
    return web.json_response({"error": error}, status=status)


async def _big(request: web.Request, state: FakeState) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    if state.big_length:
        resp.content_length = state.big_bytes
    await resp.prepare(request)
    piece = b" " * 65536
    for _ in range(state.big_bytes // len(piece)):
        await resp.write(piece)
    await resp.write_eof()
    return resp


def _whole(state: FakeState, body: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    text = f"echo:{_prompt(body)}"[:64]
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": state.model,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": usage,
    }


async def _stream(
    request: web.Request,
    state: FakeState,
    body: dict[str, Any],
    usage: dict[str, Any],
    headers: dict[str, str],
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chat = request.path.endswith("/chat/completions")  # as vLLM: the endpoint decides
    num_chunks = state.num_chunks if state.num_chunks is not None else int(body["max_tokens"])
    gaps = state.chunk_gaps_s or (state.chunk_delay_s,) * num_chunks
    if chat:  # vLLM sends the role first, with empty content
        role = {"role": "assistant", "content": ""}
        await _send(resp, {"choices": [{"index": 0, "delta": role}]})
    for i, gap_s in enumerate(gaps):
        if state.die_after_chunks is not None and i >= state.die_after_chunks:
            assert request.transport is not None
            request.transport.close()
            return resp
        if gap_s:
            await asyncio.sleep(gap_s)
        piece = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
        await _send(resp, {"choices": [{"index": 0, **piece}], "i": i, "from": state.name})
    if (body.get("stream_options") or {}).get("include_usage"):
        await _send(resp, {"choices": [], "usage": usage})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card: dict[str, Any] = {"id": state.model, "object": "model", "parent": None}
    if state.max_model_len is not None:
        card["max_model_len"] = state.max_model_len
    cards = [card] + [{"id": a, "object": "model", "parent": state.model} for a in state.adapters]
    return web.json_response({"object": "list", "data": cards})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=request.app[STATE].health_status)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    index = int(request.match_info.get("index", "0"))
    if index >= len(state.counters):
        raise web.HTTPNotFound()
    text = state.metrics_text or state.counters[index].metrics(state.model)
    return web.Response(text=text, content_type="text/plain")


def make_fake_app(state: FakeState) -> web.Application:
    app = web.Application(client_max_size=64 << 20)  # prompts of megabytes, inline images
    app[STATE] = state
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/b{index:\\d+}/metrics", _metrics)
    return app


class FakeBackend:
    """One running fake backend on loopback (``url`` is set by ``start``)."""

    def __init__(self, name: str = "fake", model: str = "m1", **fields: Any) -> None:
        self.state = FakeState(name=name, model=model, **fields)
        self.url = ""
        self._runner = web.AppRunner(
            make_fake_app(self.state), access_log=None, handler_cancellation=True
        )  # a client going away cancels its handler, as in vLLM

    async def start(self) -> FakeBackend:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def close(self) -> None:
        self.state.release.set()
        await self._runner.cleanup()


# ---- the benchmarks' backend: canned bytes, almost no CPU per request -------------------

_CANNED_USAGE = b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}'
CANNED_COMPLETION = (
    b'{"id":"cmpl-1","object":"text_completion","created":0,"model":"m",'
    b'"choices":[{"index":0,"text":" ok","finish_reason":"length"}],' + _CANNED_USAGE
)
CANNED_CHAT = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"length"}],' + _CANNED_USAGE
)


def make_canned_app() -> web.Application:
    """Model "m"; every completion gets the same answer, whatever it asked."""

    def answer(canned: bytes) -> Any:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=canned, content_type="application/json")

        return handler

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", answer(CANNED_COMPLETION))
    app.router.add_post("/v1/chat/completions", answer(CANNED_CHAT))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A canned OpenAI-compatible backend (model m).")
    p.add_argument("port", type=int)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_canned_app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
