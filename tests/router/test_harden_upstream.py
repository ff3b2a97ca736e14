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
from typing import Any

import pytest

from kvroute.bench.fake_backend import FakeBackend
from kvroute.core.keys import Prompt
from kvroute.router import route_request
from kvroute.router.breaker import CircuitState
from kvroute.router.config import BreakerConfig, HealthConfig, LimitConfig, TimeoutConfig
from tests.conftest import until
from tests.router.conftest import Harness

BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 4}'
STREAM = b'{"model": "m1", "prompt": "hello", "stream": true}'


MODES: dict[str, dict[str, Any]] = {
    "ok": {}, "500": {"fail_status": 500}, "503": {"fail_status": 503}, "reset": {"reset": True},
    "hang": {"hang": True}, "big": {}, "stream": {},
}  # fmt: skip


class Backends:
    """Starts scripted backends; closes them after the routers (request before harness)."""

    def __init__(self) -> None:
        self.started: list[FakeBackend] = []

    async def __call__(self, *modes: str) -> list[FakeBackend]:
        """One fake per mode: ok | 500 | 503 | reset | hang | big | stream (the test sets
        the big answer's size and the stream's gaps)."""
        out = []
        for mode in modes:
            b = await FakeBackend(f"b{len(self.started)}", **MODES[mode]).start()
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


def _seen(backends: list[FakeBackend]) -> list[int]:
    return [len(b.state.requests) for b in backends]


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
    slow.state.stall_s = 0.3
    client = await harness.router(
        [slow.url], timeouts=TimeoutConfig(first_byte_s=0.05, response_s=30.0)
    )
    status, body = await _post(client)
    assert status == 200, "a whole answer has response_s, not first_byte_s"
    client = await harness.router([hung.url], timeouts=TimeoutConfig(first_byte_s=0.2))
    status, body = await _post(client, STREAM)
    assert status == 504
    assert "first_byte_s" in body["error"]["message"]
    assert len(hung.state.requests) == 1


async def test_503_is_retried_once_on_another_backend_and_counts_against_it(
    scripted: Backends, harness: Harness
) -> None:
    bs = await scripted("503", "503", "503")
    client = await harness.router([b.url for b in bs], breaker=BreakerConfig(failure_threshold=2))
    status, body = await _post(client)
    assert status == 503
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
    assert len(good.state.requests) == 6


# -- finding 4: a whole answer is read up to limits.max_response_bytes --------------


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
async def test_an_answer_over_max_response_bytes_is_a_502_and_the_upstream_is_closed(
    scripted: Backends, harness: Harness, announced: bool
) -> None:
    (b,) = await scripted("big")
    b.state.big_bytes = 64 << 20  # more than loopback buffers hold: the sender notices
    b.state.big_length = announced
    client = await harness.router([b.url], limits=LimitConfig(max_response_bytes=1 << 20))
    status, body = await _post(client)
    assert status == 502
    assert body["error"]["code"] == "backend_failed"
    assert "limits.max_response_bytes" in body["error"]["message"]
    await until(lambda: b.state.num_aborted == 1)  # the router stopped reading


async def test_an_answer_under_max_response_bytes_passes_whole(
    scripted: Backends, harness: Harness
) -> None:
    (b,) = await scripted("big")
    b.state.big_bytes = 512 << 10
    b.state.big_length = False
    client = await harness.router([b.url], limits=LimitConfig(max_response_bytes=1 << 20))
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert len(await resp.read()) == 512 << 10


# -- finding 10: big prompts are keyed off the event loop -----------------------------


async def test_the_default_body_limit_fits_a_20_mb_inline_image_not_more(
    scripted: Backends, harness: Harness
) -> None:
    """OpenAI takes images of up to 20 MB, inline as base64 (27 MB of text)."""
    (b,) = await scripted("ok")
    client = await harness.router([b.url], limits=LimitConfig(retry_backoff_s=0.0))
    assert LimitConfig().max_body_bytes == 32 << 20
    image = "data:image/png;base64," + "A" * (20_000_000 * 4 // 3)
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": image}}]  # fmt: skip
    chat = {"model": "m1", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    resp = await client.post("/v1/chat/completions", data=io.BytesIO(json.dumps(chat).encode()))
    assert resp.status == 200 and len(b.state.requests) == 1
    over = b'{"model": "m1", "prompt": "' + b"a" * (32 << 20) + b'"}'
    resp = await client.post("/v1/completions", data=io.BytesIO(over))  # chunked
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    assert len(b.state.requests) == 1


async def test_a_big_exact_mode_prompt_is_keyed_while_the_router_keeps_answering(
    scripted: Backends, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in tokenizer is held inside the big request's keying until the test has
    seen /health and a small request answered: possible only if keying left the loop."""
    (b,) = await scripted("ok")
    client = await harness.router([b.url], policy="prefix", mode="exact")
    started, go = threading.Event(), threading.Event()
    order: list[str] = []
    real = route_request.prompt_token_ids

    def held(prompt: Prompt) -> list[int]:
        if prompt.text is not None and len(prompt.text) > 100_000:
            started.set()
            go.wait(10.0)  # on the loop this would block everything for 10 s
            order.append("big keyed")
        return real(prompt)

    monkeypatch.setattr(route_request, "prompt_token_ids", held)
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
    assert b.state.requests[-1]["body"].startswith(b'{"model": "m1", "prompt": "word word')


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
    upstream = [r["headers"]["x-request-id"] for r in b.state.requests]
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
) -> tuple[FakeBackend, Any, str]:
    """A stream that pauses between events, its router (idle_s 0.1 s, scraping its
    gauges), and the text the client received."""
    (b,) = await scripted("stream")
    b.state.chunk_gaps_s = gaps_s
    b.state.metrics_text = metrics
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


async def _idle_again(harness: Harness, client: Any, b: FakeBackend) -> None:
    """Healthy and reporting no work again (the teardown's leak check reads merged load)."""
    b.state.metrics_text, b.state.health_status = IDLE, 200
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
    assert '"code":"backend_timeout"' in text and "no running or waiting request" in text
    assert text.endswith("data: [DONE]\n\n")
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None and rt.breaker.failures == 0, "a slow request is not a dead backend"
    await until(lambda: b.state.num_aborted == 1)  # the engine was told to stop


async def test_a_busy_engine_is_waited_for_up_to_stall_s(
    scripted: Backends, harness: Harness
) -> None:
    b, client, text = await _paused_stream(scripted, harness, BUSY, (0.0, 5.0), stall_s=0.4)
    assert '"code":"backend_timeout"' in text and "timeouts.stall_s" in text
    rt = harness.state(client).backends.get(b.url)
    assert rt is not None and rt.breaker.failures == 0
    await _idle_again(harness, client, b)


async def test_a_stream_of_a_backend_that_turned_unhealthy_is_cut_and_charged(
    scripted: Backends, harness: Harness
) -> None:
    (b,) = await scripted("stream")
    b.state.chunk_gaps_s = (0.0, 5.0)
    b.state.metrics_text = BUSY
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
    b.state.health_status = 500
    text = (await resp.read()).decode()
    assert '"code":"backend_timeout"' in text and "unhealthy" in text
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
    assert [r["body"] for r in b.state.requests] == [big]


# -- a backend URL that is not an engine's API ---------------------------------------


@pytest.fixture
async def odd_backend() -> AsyncIterator[Any]:
    """Starts loopback servers answering every POST 200 with a fixed body and type (and
    every GET 200, so the health probe passes, as a web UI's would)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    servers: list[TestServer] = []

    async def start(body: bytes, content_type: str | None) -> tuple[str, list[int]]:
        hits: list[int] = []

        async def answer(request: web.Request) -> web.StreamResponse:
            await request.read()
            hits.append(1)
            resp = web.StreamResponse()  # unlabelled: aiohttp sends octet-stream
            resp.content_length = len(body)
            if content_type is not None:
                resp.headers["Content-Type"] = content_type
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
            return resp

        async def up(request: web.Request) -> web.Response:
            return web.Response(text="up")

        app = web.Application()
        app.router.add_post("/{tail:.*}", answer)
        app.router.add_get("/{tail:.*}", up)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), hits

    yield start
    for s in servers:
        await s.close()


async def test_a_200_web_page_is_not_relayed_as_a_completion_and_counts_against_it(
    odd_backend: Any, scripted: Backends, harness: Harness
) -> None:
    page, hits = await odd_backend(b"<html>login</html>", "text/html; charset=utf-8")
    client = await harness.router([page], breaker=BreakerConfig(failure_threshold=2))
    status, body = await _post(client)
    assert status == 502
    assert "text/html" in body["error"]["message"] and "/v1" in body["error"]["message"]
    await _post(client)
    state = harness.state(client).backends.get(page)
    assert state is not None and state.breaker.state is CircuitState.OPEN
    assert len(hits) == 2


async def test_a_web_page_is_retried_on_a_real_engine(
    odd_backend: Any, scripted: Backends, harness: Harness
) -> None:
    page, hits = await odd_backend(b"<html>hi</html>", "text/html")
    (ok,) = await scripted("ok")
    client = await harness.router([page, ok.url])
    for _ in range(2):  # round-robin: one of them starts on the page
        status, body = await _post(client)
        assert status == 200 and body["choices"], body
    assert len(hits) == 1 and len(ok.state.requests) == 2


async def test_an_empty_200_is_a_502_and_an_unlabelled_answer_passes(
    odd_backend: Any, harness: Harness
) -> None:
    empty, _ = await odd_backend(b"", "application/json")
    client = await harness.router([empty])
    status, body = await _post(client)
    assert status == 502 and "empty body" in body["error"]["message"]
    answer = b'{"id": "x", "object": "text_completion", "choices": [{"text": "hi"}]}'
    plain, _ = await odd_backend(answer, None)
    client = await harness.router([plain])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200 and await resp.read() == answer


async def test_a_stream_closed_cleanly_before_done_ends_with_an_error_event(
    odd_backend: Any, harness: Harness
) -> None:
    """The OpenAI SDKs stop at the end of a stream without a word: a cut answer must say
    it is cut, as a dropped connection's does."""
    cut = b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n\n'
    url, _ = await odd_backend(cut, "text/event-stream")
    client = await harness.router([url])
    resp = await client.post("/v1/completions", data=STREAM)
    assert resp.status == 200  # the first byte went out before the end was known
    text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[0] == cut.decode().strip().removeprefix("data: ")
    assert json.loads(events[1])["error"]["code"] == "backend_failed"
    assert "ended before [DONE]" in json.loads(events[1])["error"]["message"]
    assert events[2:] == ["[DONE]"]
    metrics = await (await client.get("/metrics")).text()
    assert f'kvroute_midstream_failures_total{{backend="{url}"}} 1.0' in metrics


async def test_a_stream_that_ends_on_the_engines_own_error_event_gets_only_done(
    odd_backend: Any, harness: Harness
) -> None:
    """llama.cpp ends a failed stream with its error event and no [DONE]
    (tools/server/server-context.cpp): the client needs the [DONE], not a second error."""
    chunk = b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n\n'
    error = b'data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}\n\n'
    url, _ = await odd_backend(chunk + error, "text/event-stream")
    client = await harness.router([url])
    resp = await client.post("/v1/completions", data=STREAM)
    text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events == [chunk.decode().strip(), error.decode().strip(), "data: [DONE]"]
