"""Hardening of the request path (issue 9): what a client can make the backends do.

Real HTTP on loopback: the router in front of scripted backends that answer 500 or 503,
reset the connection, hang, send huge bodies or pause mid-stream. Each test counts how
many times each backend saw the body and reads the circuit state afterwards.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.core.keys import Prompt
from kvroute.router import proxy
from kvroute.router.breaker import CircuitState
from kvroute.router.config import BreakerConfig, HealthConfig, LimitConfig, TimeoutConfig
from tests.conftest import until
from tests.router.conftest import Harness

BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 4}'
STREAM = b'{"model": "m1", "prompt": "hello", "stream": true}'


@dataclass
class Script:
    """What one scripted backend does with a completion request, and what it saw."""

    name: str
    mode: str = "ok"  # ok | 500 | 503 | reset | hang | big | stream
    delay_s: float = 0.0  # "ok": think this long before answering
    big_bytes: int = 0  # "big": body size
    big_length: bool = True  # "big": announce it in Content-Length
    gaps_s: tuple[float, ...] = ()  # "stream": pause before each event
    metrics_text: str = ""  # its /metrics page (vLLM gauges)
    health_status: int = 200  # what /health answers
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    num_cancelled: int = 0  # requests whose connection the router closed


class ScriptedBackend:
    """One scripted backend on loopback (health, models and metrics always answer)."""

    def __init__(self, name: str) -> None:
        self.script = Script(name)
        self.release = asyncio.Event()  # ends "hang" handlers at close
        self.server = TestServer(self._app(), host="127.0.0.1")
        self.url = ""

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.script.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m1"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.script.metrics_text)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        s = self.script
        s.bodies.append(await request.read())
        s.headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            return await self._answer(request, s)
        except (asyncio.CancelledError, ConnectionError):
            s.num_cancelled += 1
            raise

    async def _answer(self, request: web.Request, s: Script) -> web.StreamResponse:
        if s.mode in ("500", "503"):
            error = {"error": {"message": f"engine says {s.mode}", "type": "x", "code": 1}}
            return web.json_response(error, status=int(s.mode))
        if s.mode == "reset":
            assert request.transport is not None
            request.transport.close()  # read the body, then drop the connection
            return web.Response()
        if s.mode == "hang":
            await self.release.wait()
            return web.Response(status=500)
        if s.mode == "big":
            return await self._big(request, s)
        if s.mode == "stream":
            return await self._stream(request, s)
        if s.delay_s:
            await asyncio.sleep(s.delay_s)
        usage = {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
        return web.json_response({"from": s.name, "usage": usage})

    async def _big(self, request: web.Request, s: Script) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"}
        resp = web.StreamResponse(headers=headers)
        if s.big_length:
            resp.content_length = s.big_bytes
        await resp.prepare(request)
        piece = b" " * 65536
        for _ in range(s.big_bytes // len(piece)):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def _stream(self, request: web.Request, s: Script) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, gap_s in enumerate(s.gaps_s):
            if gap_s:
                await asyncio.sleep(gap_s)
            await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def start(self) -> ScriptedBackend:
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self

    async def close(self) -> None:
        self.release.set()
        await self.server.close()


class Backends:
    """Starts scripted backends; closes them after the routers (request before harness)."""

    def __init__(self) -> None:
        self.started: list[ScriptedBackend] = []

    async def __call__(self, *modes: str) -> list[ScriptedBackend]:
        out = []
        for mode in modes:
            b = await ScriptedBackend(f"b{len(self.started)}").start()
            b.script.mode = mode
            self.started.append(b)
            out.append(b)
        return out


@pytest.fixture
async def scripted() -> AsyncIterator[Backends]:
    """Listed before ``harness`` in a test's arguments, so routers close first."""
    backends = Backends()
    yield backends
    for b in backends.started:
        await b.close()


def _seen(backends: list[ScriptedBackend]) -> list[int]:
    return [len(b.script.bodies) for b in backends]


async def _post(client: Any, body: bytes = BODY) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/v1/completions", data=body)
    return resp.status, json.loads(await resp.read())


# -- finding 2: a client cannot open the circuits or multiply its own request ---------


async def test_requests_the_engine_answers_500_reach_one_backend_and_open_no_circuit(
    scripted: Backends, harness: Harness
) -> None:
    bs = await scripted("500", "500", "500")
    client = await harness.router([b.url for b in bs], breaker=BreakerConfig(failure_threshold=2))
    for _ in range(6):
        status, body = await _post(client)
        assert status == 502
        assert "answered 500" in body["error"]["message"]
        assert "engine says 500" in body["error"]["message"]
    assert sum(_seen(bs)) == 6, "each request went to one backend only"
    state = harness.state(client)
    for b in bs:
        rt = state.backends.get(b.url)
        assert rt is not None and rt.breaker.state is CircuitState.CLOSED
        assert rt.routable


async def test_a_body_that_resets_the_connection_is_delivered_once(
    scripted: Backends, harness: Harness
) -> None:
    bs = await scripted("reset", "reset", "reset")
    client = await harness.router([b.url for b in bs], breaker=BreakerConfig(failure_threshold=2))
    for i in range(4):
        status, body = await _post(client)
        assert status == 502
        assert "closed the connection" in body["error"]["message"]
        assert sum(_seen(bs)) == i + 1, "never re-sent, not to the same backend nor another"
    state = harness.state(client)
    assert all(state.backends.get(b.url).breaker.state is CircuitState.CLOSED for b in bs)  # type: ignore[union-attr]


async def test_a_slow_answer_runs_on_one_backend_then_504_at_response_s(
    scripted: Backends, harness: Harness
) -> None:
    bs = await scripted("hang", "hang", "hang")
    client = await harness.router(
        [b.url for b in bs],
        timeouts=TimeoutConfig(response_s=0.3),
        breaker=BreakerConfig(failure_threshold=1),
    )
    status, body = await _post(client)
    assert status == 504
    assert body["error"]["code"] == "backend_timeout"
    assert "0.3 s" in body["error"]["message"]
    assert sum(_seen(bs)) == 1
    state = harness.state(client)
    assert all(state.backends.get(b.url).breaker.state is CircuitState.CLOSED for b in bs)  # type: ignore[union-attr]


async def test_first_byte_s_bounds_stream_headers_and_response_s_whole_answers(
    scripted: Backends, harness: Harness
) -> None:
    slow, hung = await scripted("ok", "hang")
    slow.script.delay_s = 0.3
    client = await harness.router(
        [slow.url], timeouts=TimeoutConfig(first_byte_s=0.05, response_s=30.0)
    )
    status, body = await _post(client)
    assert status == 200, "a whole answer has response_s, not first_byte_s"
    client = await harness.router([hung.url], timeouts=TimeoutConfig(first_byte_s=0.2))
    status, body = await _post(client, STREAM)
    assert status == 504
    assert "first_byte_s" in body["error"]["message"]
    assert len(hung.script.bodies) == 1


async def test_503_is_retried_once_on_another_backend_and_counts_against_it(
    scripted: Backends, harness: Harness
) -> None:
    bs = await scripted("503", "503", "503")
    client = await harness.router([b.url for b in bs], breaker=BreakerConfig(failure_threshold=2))
    status, body = await _post(client)
    assert status == 502
    assert "answered 503" in body["error"]["message"]
    assert sorted(_seen(bs)) == [0, 1, 1], "at most two backends saw the body"
    for _ in range(3):
        await _post(client)
    state = harness.state(client)
    states = [state.backends.get(b.url).breaker.state for b in bs]  # type: ignore[union-attr]
    assert states.count(CircuitState.OPEN) >= 2, "503 says the backend cannot take work"


async def test_connect_errors_do_not_count_as_deliveries(
    scripted: Backends, harness: Harness
) -> None:
    dead, busy, good = await scripted("ok", "503", "ok")
    client = await harness.router([dead.url, busy.url, good.url])
    await dead.close()  # healthy at startup, refuses connections now
    for _ in range(6):
        status, _ = await _post(client)
        assert status == 200
    assert len(good.script.bodies) == 6


# -- finding 4: a whole answer is read up to limits.max_response_bytes --------------


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
async def test_an_answer_over_max_response_bytes_is_a_502_and_the_upstream_is_closed(
    scripted: Backends, harness: Harness, announced: bool
) -> None:
    (b,) = await scripted("big")
    b.script.big_bytes = 64 << 20  # more than loopback buffers hold: the sender notices
    b.script.big_length = announced
    client = await harness.router([b.url], limits=LimitConfig(max_response_bytes=1 << 20))
    status, body = await _post(client)
    assert status == 502
    assert body["error"]["code"] == "backend_failed"
    assert "limits.max_response_bytes" in body["error"]["message"]
    await until(lambda: b.script.num_cancelled == 1)  # the router stopped reading


async def test_an_answer_under_max_response_bytes_passes_whole(
    scripted: Backends, harness: Harness
) -> None:
    (b,) = await scripted("big")
    b.script.big_bytes = 512 << 10
    b.script.big_length = False
    client = await harness.router([b.url], limits=LimitConfig(max_response_bytes=1 << 20))
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert len(await resp.read()) == 512 << 10


# -- finding 10: big prompts are keyed off the event loop -----------------------------


async def test_the_default_body_limit_fits_a_1m_token_prompt_not_more(
    scripted: Backends, harness: Harness
) -> None:
    (b,) = await scripted("ok")
    client = await harness.router([b.url], limits=LimitConfig(retry_backoff_s=0.0))
    assert LimitConfig().max_body_bytes == 4 << 20
    over = b'{"model": "m1", "prompt": "' + b"a" * (4 << 20) + b'"}'
    resp = await client.post("/v1/completions", data=io.BytesIO(over))  # chunked
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    assert not b.script.bodies


async def test_a_big_exact_mode_prompt_is_keyed_while_the_router_keeps_answering(
    scripted: Backends, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in tokenizer is held inside the big request's keying until the test has
    seen /health and a small request answered: possible only if keying left the loop."""
    (b,) = await scripted("ok")
    client = await harness.router([b.url], policy="prefix", mode="exact")
    started, go = threading.Event(), threading.Event()
    order: list[str] = []
    real = proxy.prompt_token_ids

    def held(prompt: Prompt) -> list[int]:
        if prompt.text is not None and len(prompt.text) > 100_000:
            started.set()
            go.wait(10.0)  # on the loop this would block everything for 10 s
            order.append("big keyed")
        return real(prompt)

    monkeypatch.setattr(proxy, "prompt_token_ids", held)
    big = asyncio.ensure_future(
        client.post("/v1/completions", json={"model": "m1", "prompt": "word " * 60_000})
    )
    await until(started.is_set)
    assert (await client.get("/health")).status == 200
    order.append("health")
    small = await client.post("/v1/completions", json={"model": "m1", "prompt": "hi"})
    assert small.status == 200
    order.append("small")
    go.set()
    resp = await big
    assert resp.status == 200
    assert order == ["health", "small", "big keyed"]
    assert b.script.bodies[-1].startswith(b'{"model": "m1", "prompt": "word word')


# -- finding 12: the engine gets the router's request id, the client keeps its own ----


async def test_the_upstream_request_id_is_the_routers_not_the_clients(
    scripted: Backends, harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    (b,) = await scripted("ok")
    client = await harness.router([b.url])
    caplog.set_level(logging.DEBUG, logger="kvroute.router.requests")
    answers = []
    for _ in range(2):  # two tenants that picked the same id
        resp = await client.post("/v1/completions", data=BODY, headers={"x-request-id": "r-1"})
        assert resp.status == 200
        answers.append(resp.headers["x-request-id"])
    plain = await client.post("/v1/completions", data=BODY)
    upstream = [h["x-request-id"] for h in b.script.headers]
    assert answers == ["r-1", "r-1"], "the client gets its own id back"
    assert "r-1" not in upstream
    assert len(set(upstream)) == 3, "each request has its own id upstream"
    assert plain.headers["x-request-id"] == upstream[2], "no client id: one id end to end"
    logged = caplog.text
    assert all(f"r-1 (upstream {u})" in logged for u in upstream[:2])


# -- finding 15: a stream the engine is still working on is not cut at idle_s --------

BUSY = "vllm:num_requests_running 1\nvllm:num_requests_waiting 3\n"
IDLE = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


async def _paused_stream(
    scripted: Backends,
    harness: Harness,
    metrics: str,
    gaps_s: tuple[float, ...],
    *,
    stall_s: float,
) -> tuple[ScriptedBackend, Any, str]:
    """A stream that pauses between events, its router (idle_s 0.1 s, scraping its
    gauges), and the text the client received."""
    (b,) = await scripted("stream")
    b.script.gaps_s = gaps_s
    b.script.metrics_text = metrics
    client = await harness.router(
        [b.url],
        timeouts=TimeoutConfig(idle_s=0.1, stall_s=stall_s),
        health=HealthConfig(interval_s=3600, timeout_s=1.0, scrape_interval_s=0.05),
    )
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None
    await until(lambda: rt.engine is not None)
    resp = await client.post("/v1/completions", data=STREAM)
    assert resp.status == 200
    return b, client, (await resp.read()).decode()


async def _idle_again(harness: Harness, client: Any, b: ScriptedBackend) -> None:
    """Healthy and reporting no work again (the teardown's leak check reads merged load)."""
    b.script.metrics_text, b.script.health_status = IDLE, 200
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None
    await until(lambda: rt.probe_ok and rt.engine is not None and rt.engine.num_waiting == 0)


async def test_a_stream_paused_by_a_busy_healthy_engine_is_waited_for(
    scripted: Backends, harness: Harness
) -> None:
    b, client, text = await _paused_stream(scripted, harness, BUSY, (0.0, 0.6, 0.0), stall_s=30)
    assert '"error"' not in text
    assert [f'"i": {i}' in text for i in range(3)] == [True] * 3
    assert text.endswith("data: [DONE]\n\n")
    await _idle_again(harness, client, b)


async def test_a_stream_paused_by_an_idle_engine_is_cut_and_says_so(
    scripted: Backends, harness: Harness
) -> None:
    b, client, text = await _paused_stream(scripted, harness, IDLE, (0.0, 5.0), stall_s=30)
    assert '"code":504' in text and "no running or waiting request" in text
    assert text.endswith("data: [DONE]\n\n")
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None and rt.breaker.failures == 0, "a slow request is not a dead backend"
    await until(lambda: b.script.num_cancelled == 1)  # the engine was told to stop


async def test_a_busy_engine_is_waited_for_up_to_stall_s(
    scripted: Backends, harness: Harness
) -> None:
    b, client, text = await _paused_stream(scripted, harness, BUSY, (0.0, 5.0), stall_s=0.4)
    assert '"code":504' in text and "timeouts.stall_s" in text
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None and rt.breaker.failures == 0
    await _idle_again(harness, client, b)


async def test_a_stream_of_a_backend_that_turned_unhealthy_is_cut_and_charged(
    scripted: Backends, harness: Harness
) -> None:
    (b,) = await scripted("stream")
    b.script.gaps_s = (0.0, 5.0)
    b.script.metrics_text = BUSY
    client = await harness.router(
        [b.url],
        timeouts=TimeoutConfig(idle_s=0.1, stall_s=30),
        health=HealthConfig(interval_s=0.05, timeout_s=1.0, scrape_interval_s=0.05),
    )
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None
    await until(lambda: rt.engine is not None)
    resp = await client.post("/v1/completions", data=STREAM)
    await resp.content.readany()  # the first event: the stream is paused now
    b.script.health_status = 500
    text = (await resp.read()).decode()
    assert '"code":504' in text and "unhealthy" in text
    assert rt.breaker.failures == 1 or rt.breaker.state is not CircuitState.CLOSED
    await _idle_again(harness, client, b)


async def test_a_prompt_over_1_mib_reaches_the_backend_whole(
    scripted: Backends, harness: Harness
) -> None:
    """aiohttp warns (ResourceWarning, an error under pytest's filter) when a bytes body
    over 1 MiB is sent in one write; the proxy sends such bodies in chunks instead."""
    (b,) = await scripted("ok")
    client = await harness.router([b.url])
    big = b'{"model": "m1", "prompt": "' + b"word " * (600 << 10) + b'"}'
    resp = await client.post("/v1/completions", data=io.BytesIO(big))
    assert resp.status == 200, await resp.text()
    assert b.script.bodies == [big]
