"""The aiohttp app of one simulated backend: vLLM's OpenAI-compatible HTTP surface.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /version``,
``POST /tokenize``, ``POST /reset_prefix_cache``, and the simulator's own admin
``GET|POST|DELETE /sim/faults`` (see faults.py).

A handler validates (400/404 in vLLM's error shape), waits the API overhead, submits to
the engine and relays tokens as they come, one SSE chunk per token. Whatever happens
(finish, client disconnect, dropped connection), the ``finally`` aborts the request in
the engine, which is a no-op once it finished, so blocks are always freed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from kvroute.engine.engine import TokenOutput
from kvroute.sim import protocol
from kvroute.sim.engine_loop import EngineLoop, TokenStream
from kvroute.sim.metrics import CONTENT_TYPE
from kvroute.sim.protocol import ApiError, SimRequest

BACKEND = web.AppKey("backend", EngineLoop)
MAX_BODY_BYTES = 64 * 1024 * 1024
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def make_sim_app(backend: EngineLoop) -> web.Application:
    """The app serving ``backend``; its startup/cleanup run the engine loop."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[BACKEND] = backend
    app.cleanup_ctx.append(_engine_life)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_delete("/sim/faults", clear_faults)
    return app


async def _engine_life(app: web.Application) -> AsyncIterator[None]:
    backend = app[BACKEND]
    await backend.start_engine()
    yield
    await backend.stop_engine()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), err.status)


async def _read_json(request: web.Request) -> Any:
    try:
        return _decode(await request.read())
    except msgspec.DecodeError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None


@dataclass(slots=True)
class _Progress:
    """What one request has produced so far (for the response and the metrics)."""

    rid: str
    arrival_s: float  # loop time when the request arrived
    num_prompt: int
    num_output: int = 0
    num_cached: int = 0
    ttft_s: float | None = None
    finish_reason: str | None = None

    def on_token(self, out: TokenOutput, stream: TokenStream, backend: EngineLoop) -> None:
        self.num_output += 1
        self.num_cached = out.num_cached_tokens
        self.finish_reason = out.finish_reason
        if self.ttft_s is None and stream.first_token_at is not None:
            self.ttft_s = stream.first_token_at - self.arrival_s
            backend.metrics.record_first_token(self.ttft_s)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    backend = request.app[BACKEND]
    loop = asyncio.get_running_loop()
    arrival = loop.time()
    try:
        await _apply_request_faults(backend)
        req = protocol.parse_request(
            await _read_json(request),
            chat=chat,
            model_name=backend.model_name,
            max_model_len=backend.profile.max_model_len,
            tokenizer=backend.tokenizer,
        )
    except ApiError as err:
        return error_response(err)
    delay = backend.api_delay_s()
    if delay > 0:
        await asyncio.sleep(delay)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        stream = backend.submit(
            rid, req.prompt_token_ids, req.max_tokens, req.seed, req.cache_salt,
            wake_on_finish=not req.stream and backend.faults.drop_after_chunks is None,
        )  # fmt: skip
    except ValueError as exc:
        return error_response(ApiError(str(exc)))
    progress = _Progress(rid, arrival, len(req.prompt_token_ids))
    try:
        if req.stream:
            return await _stream(request, backend, req, stream, progress)
        return await _complete(request, backend, req, stream, progress)
    finally:
        backend.abort(rid)
        backend.metrics.record_finished(
            e2e_s=loop.time() - arrival,
            ttft_s=progress.ttft_s,
            num_prompt=progress.num_prompt,
            num_output=progress.num_output,
            reason=progress.finish_reason or "abort",
        )


async def _apply_request_faults(backend: EngineLoop) -> None:
    faults = backend.faults
    if faults.error_status is not None:
        kind = "ServiceUnavailableError" if faults.error_status == 503 else "InternalServerError"
        raise ApiError("simulated failure (fault injection)", status=faults.error_status,
                       type_=kind)  # fmt: skip
    if faults.hang:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        backend.hung.add(fut)
        try:
            await fut  # never set: only cancellation (disconnect, shutdown) ends it
        finally:
            backend.hung.discard(fut)


async def _complete(
    request: web.Request, backend: EngineLoop, req: SimRequest,
    stream: TokenStream, progress: _Progress,
) -> web.StreamResponse:  # fmt: skip
    drop = backend.faults.drop_after_chunks
    words = backend.word_text
    pieces: list[str] = []
    while progress.finish_reason is None:
        for out in await stream.take():
            progress.on_token(out, stream, backend)
            pieces.append(words.get(out.token_id) or backend.tokenizer.decode([out.token_id]))
            if drop is not None and progress.num_output >= drop:
                return _drop_connection(request, web.Response())
    body = protocol.full_response(
        progress.rid, int(time.time()), backend.model_name, req.chat, "".join(pieces),
        progress.finish_reason,
        protocol.usage(progress.num_prompt, progress.num_output, progress.num_cached),
    )  # fmt: skip
    return json_response(body)


async def _stream(
    request: web.Request, backend: EngineLoop, req: SimRequest,
    stream: TokenStream, progress: _Progress,
) -> web.StreamResponse:  # fmt: skip
    """Relay tokens as SSE chunks; a client that goes away just ends the relay."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    drop = backend.faults.drop_after_chunks
    sent = 0
    created = int(time.time())
    try:
        while progress.finish_reason is None:
            chunks = _next_chunks(backend, req, progress, created, await stream.take(), stream)
            if drop is not None and sent + len(chunks) >= drop:
                await _write(resp, chunks[: drop - sent], b"")
                return _drop_connection(request, resp)
            sent += len(chunks)
            if progress.finish_reason is None:
                await _write(resp, chunks, b"")
        if req.include_usage:
            use = protocol.usage(progress.num_prompt, progress.num_output, progress.num_cached)
            chunks.append(
                protocol.usage_chunk(progress.rid, created, backend.model_name, req.chat, use)
            )
        await _write(resp, chunks, DONE)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away; _serve's finally aborts the request
    return resp


def _next_chunks(
    backend: EngineLoop, req: SimRequest, progress: _Progress, created: int,
    outs: list[TokenOutput], stream: TokenStream,
) -> list[dict[str, Any]]:  # fmt: skip
    """The SSE chunks of the tokens ``outs`` (written together, one token per chunk)."""
    model = backend.model_name
    chunks: list[dict[str, Any]] = []
    for out in outs:
        if progress.ttft_s is None and req.chat:
            chunks.append(protocol.stream_chunk(progress.rid, created, model, True, "", None,
                                                role=True))  # fmt: skip
        progress.on_token(out, stream, backend)
        text = backend.word_text.get(out.token_id) or backend.tokenizer.decode([out.token_id])
        chunk = protocol.stream_chunk(progress.rid, created, model, req.chat, text,
                                      out.finish_reason)  # fmt: skip
        if req.continuous_usage:
            chunk["usage"] = protocol.usage(
                progress.num_prompt, progress.num_output, progress.num_cached
            )
        chunks.append(chunk)
    return chunks


async def _write(resp: web.StreamResponse, chunks: list[dict[str, Any]], tail: bytes) -> None:
    data = b"".join(b"data: " + _encode(c) + b"\n\n" for c in chunks) + tail
    if data:
        await resp.write(data)


def _drop_connection(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Close the socket mid-answer (the ``drop`` fault); the client sees a broken stream.

    aiohttp's attempt to finish ``resp`` then meets a closed transport and gives up
    quietly, as after a client disconnect.
    """
    transport = request.transport
    if transport is not None:
        transport.abort()
    return resp


# ---- the other endpoints ------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    name = backend.model_name
    card = {
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        "root": name, "parent": None, "max_model_len": backend.profile.max_model_len,
        "permission": [],
    }  # fmt: skip
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    if not request.app[BACKEND].faults.is_healthy(asyncio.get_running_loop().time()):
        return web.Response(status=503)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[BACKEND].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": "kvroute-sim"})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: ``{"prompt": str}`` or ``{"messages": [...]}`` -> token ids."""
    backend = request.app[BACKEND]
    try:
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        ids = protocol.prompt_ids(body, "messages" in body, backend.tokenizer)
    except ApiError as err:
        return error_response(err)
    return json_response({"count": len(ids), "max_model_len": backend.profile.max_model_len,
                          "tokens": ids, "token_strs": None})  # fmt: skip


async def reset_prefix_cache(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    if not backend.engine.reset_prefix_cache():
        raise web.HTTPInternalServerError(text="cannot reset the prefix cache while running")
    backend.publish_kv_events()
    return web.Response(status=200)


async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[BACKEND].faults.to_json())


async def set_faults(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    try:
        changes = await _read_json(request)
        try:
            backend.faults.update(changes)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
    except ApiError as err:
        return error_response(err)
    return json_response(backend.faults.to_json())


async def clear_faults(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    backend.faults.clear()
    return json_response(backend.faults.to_json())
