"""HTTP on both sides of the router as the RFCs and real clients and engines have it:
HTTP/1.0 clients, compressing engines, hop-by-hop headers, trace context."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
from typing import Any

import pytest
from aiohttp import web

from kvroute.router.config import ClientKey
from tests.router.conftest import Harness

STREAM = b'{"model": "m1", "prompt": "hello", "max_tokens": 2, "stream": true}'
BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 2}'
CHUNK = b'data: {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}\n\n'


async def _sse(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    out.enable_compression()  # gzip when the request's Accept-Encoding allows it
    await out.prepare(request)
    await out.write(CHUNK)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def test_an_http10_keep_alive_client_sees_a_stream_end(harness: Harness) -> None:
    """An HTTP/1.0 answer of no length ends only when the connection closes: the router
    kept a keep-alive one open, so the client hung until the keep-alive timeout (75 s)."""
    b = await harness.backend()
    client = await harness.router([b.url])
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM)
    )
    try:
        data = await asyncio.wait_for(reader.read(), 10)  # to EOF: the end of the answer
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Transfer-Encoding" not in head
    assert body.rstrip().endswith(b"data: [DONE]")


async def test_an_http10_whole_answer_keeps_its_connection(harness: Harness) -> None:
    b = await harness.backend()
    client = await harness.router([b.url])
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    request = (
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )
    try:
        for _ in range(2):  # a second request on the same connection is answered too
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.0 200")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            assert b'"choices"' in await reader.readexactly(length)
    finally:
        writer.close()


async def test_a_compressing_engine_is_asked_for_plain_answers(
    harness: Harness, engine: Any
) -> None:
    """The client's Accept-Encoding went upstream: an engine that compresses sent gzip,
    which the router relayed and then appended its own plain-text events to."""
    url, seen = await engine(_sse)
    client = await harness.router([url])
    resp = await client.post(
        "/v1/completions", data=STREAM, headers={"Accept-Encoding": "gzip"}, auto_decompress=False
    )
    raw = await resp.read()
    body = gzip.decompress(raw) if resp.headers.get("Content-Encoding") == "gzip" else raw
    assert body == CHUNK + b"data: [DONE]\n\n"
    assert seen[-1]["Accept-Encoding"] == "identity"
    metrics = await (await client.get("/metrics")).text()
    assert f'kvroute_midstream_failures_total{{backend="{url}"}} 1.0' not in metrics


async def test_headers_the_engine_calls_hop_by_hop_do_not_reach_the_client(
    harness: Harness, engine: Any
) -> None:
    """RFC 9110 section 7.6.1: a field named in Connection is for that connection only."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]},
            headers={"Connection": "keep-alive, X-Hop", "X-Hop": "secret", "X-End": "kept"},
        )

    url, _ = await engine(answer)
    client = await harness.router([url])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert "X-Hop" not in resp.headers and resp.headers["X-End"] == "kept"


async def test_trace_context_and_user_agent_reach_the_engine_and_cookies_do_not(
    harness: Harness, engine: Any
) -> None:
    url, seen = await engine(_sse)
    client = await harness.router([url])
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = {"traceparent": parent, "tracestate": "k=v", "User-Agent": "OpenAI/Python 2.8.1",
            "Cookie": "session=abc"}  # fmt: skip
    resp = await client.post("/v1/completions", data=STREAM, headers=sent)
    assert resp.status == 200
    await resp.read()
    got = seen[-1]
    assert got["traceparent"] == parent and got["tracestate"] == "k=v"
    assert got["User-Agent"] == "OpenAI/Python 2.8.1"
    assert "Cookie" not in got


async def _exchange(port: int, raw: bytes) -> bytes:
    """The router's answer to ``raw``: its head and its Content-Length body (10 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        while head.startswith(b"HTTP/1.1 1"):  # an interim answer (100 Continue)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return head + await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


async def test_100_continue_comes_only_when_the_router_reads_the_body(harness: Harness) -> None:
    """aiohttp sent "100 Continue" before the handler ran: a client uploaded a body only
    to be refused for its key or its size."""
    b = await harness.backend()
    client = await harness.router([b.url], client_keys=(ClientKey(name="t", key="sk-test-1"),))
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n"
    )
    refused = await _exchange(client.port, head % len(BODY) + b"\r\n")  # no key, no body
    assert refused.startswith(b"HTTP/1.1 401") and b"100 Continue" not in refused
    assert b"Connection: close" in refused
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        writer.write(head % len(BODY) + b"Authorization: Bearer sk-test-1\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_an_expectation_other_than_100_continue_is_an_openai_417(harness: Harness) -> None:
    b = await harness.backend()
    client = await harness.router([b.url])
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: teapot\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    )
    answer = await _exchange(client.port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 417"), answer[:200]
    assert b'"code":"expectation_failed"' in body and b"x-request-id" in head
    assert not b.state.requests


async def test_405_says_which_methods_the_path_takes(harness: Harness) -> None:
    b = await harness.backend()
    client = await harness.router([b.url])
    resp = await client.put("/v1/completions", data=BODY)
    assert resp.status == 405
    assert "POST" in resp.headers["Allow"]
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_an_http2_request_line_is_505(harness: Harness) -> None:
    """HTTP/2 is not spoken over an HTTP/1 connection: aiohttp answered "HTTP/2.0 200"."""
    b = await harness.backend()
    client = await harness.router([b.url])
    answer = await _exchange(client.port, b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b" 505 " in head.split(b"\r\n")[0], answer[:200]
    assert b'"code":"http_version_not_supported"' in body


# -- a second HTTP review (seventeenth session) ---------------------------------------


async def test_an_engines_redirect_is_not_followed(harness: Harness, engine: Any) -> None:
    """aiohttp follows redirects by default: a 307 from a backend made the router re-POST
    the client's prompt to the Location host and relay that host's answer as the engine's."""
    _, elsewhere = await engine(_sse)
    target, _ = await engine(_sse)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{target}/v1/completions")

    url, seen = await engine(redirect)
    client = await harness.router([url])
    resp = await client.post("/v1/completions", data=STREAM)
    assert resp.status >= 500
    assert "redirect" in (await resp.json())["error"]["message"]
    assert len(seen) == 1 and not elsewhere


async def test_the_routers_own_headers_win_and_repeated_ones_are_kept(
    harness: Harness, engine: Any
) -> None:
    """vLLM with --enable-request-id-headers echoes its own x-request-id: clients got two
    and joined them; two Set-Cookie collapsed to one; TE and Proxy-Connection passed."""

    async def answer(request: web.Request) -> web.Response:
        resp = web.json_response({"object": "text_completion", "choices": []})
        for name, value in (("x-request-id", "engine-rid"), ("X-Kvroute-Backend", "forged"),
                            ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("TE", "trailers"),
                            ("Proxy-Connection", "keep-alive")):  # fmt: skip
            resp.headers.add(name, value)
        return resp

    url, _ = await engine(answer)
    client = await harness.router([url])
    resp = await client.post("/v1/completions", data=BODY, headers={"x-request-id": "mine"})
    assert resp.status == 200
    assert resp.headers.getall("x-request-id") == ["mine"]
    assert resp.headers.getall("x-kvroute-backend") == [url]
    assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert "TE" not in resp.headers and "Proxy-Connection" not in resp.headers


async def test_headers_the_clients_connection_names_stay_with_the_client(
    harness: Harness, engine: Any
) -> None:
    url, seen = await engine(_sse)
    client = await harness.router([url])
    sent = {"Connection": "keep-alive, traceparent, User-Agent", "traceparent": "00-x",
            "User-Agent": "probe", "tracestate": "k=v"}  # fmt: skip
    resp = await client.post("/v1/completions", data=STREAM, headers=sent)
    await resp.read()
    assert "traceparent" not in seen[-1] and seen[-1].get("User-Agent") != "probe"
    assert seen[-1]["tracestate"] == "k=v"


async def test_a_transfer_coding_other_than_chunked_is_501(harness: Harness) -> None:
    b = await harness.backend()
    client = await harness.router([b.url])
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked
    )
    answer = await _exchange(client.port, raw)
    assert answer.startswith(b"HTTP/1.1 501"), answer[:200]
    assert b"Connection: close" in answer and not b.state.requests


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
        b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
    ],
    ids=["upgrade", "expect-404", "declared-413"],
)
async def test_answers_that_leave_the_connection_unusable_close_it(
    harness: Harness, raw: bytes
) -> None:
    """An upgrade never switched swallowed the requests pipelined after it; a 404 to a
    client waiting for 100 Continue (aiohttp's own expect handler sends that one before
    the 404), and a 413 for a declared length, kept the connection (aiohttp then read and
    dropped up to the whole body for 10 s)."""
    b = await harness.backend()
    client = await harness.router([b.url])
    answer = await _exchange(client.port, raw)
    assert b"Connection: close" in answer.split(b"\r\n\r\n")[0], answer


async def test_a_compressed_body_over_a_kilobyte_inflates_off_the_loop(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work is the output's (a 32 KB gzip of 32 MiB held the loop 120-270 ms): only
    bodies under a kilobyte inflate on the loop."""
    from kvroute.router import body as body_module

    threaded: list[int] = []
    real = asyncio.to_thread

    async def to_thread(func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is body_module.inflate:
            threaded.append(len(args[0]))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(body_module.asyncio, "to_thread", to_thread)
    b = await harness.backend()
    client = await harness.router([b.url])
    words = random.Random(0).choices(["alpha", "beta", "gamma", "delta"], k=4000)
    big = json.dumps({"model": "m1", "prompt": " ".join(words), "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    for body in (BODY, big):
        resp = await client.post("/v1/completions", data=gzip.compress(body), headers=headers)
        assert resp.status == 200, await resp.text()
    assert threaded == [len(gzip.compress(big))]
