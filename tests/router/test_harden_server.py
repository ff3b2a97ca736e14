"""Issue 9, finding 7: slow and idle clients are cut, and client connections are capped.

Real sockets against the listeners ``kvroute serve`` runs (``start_listeners``): an idle
kept-alive connection, a connection that never finishes its headers and a request whose
body never finishes are all ended after their (small, test-set) timeouts; a connection
over the cap gets 503 at once; ordinary requests and long streams are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.router.app import make_app
from kvroute.router.cli import add_parser, config_from_args
from kvroute.router.config import ServerConfig, load_config
from kvroute.router.listener import Listeners, start_listeners
from kvroute.router.state import STATE
from tests.conftest import until
from tests.router.conftest import Harness, assert_no_load, router_config

HEALTH = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"


@contextlib.asynccontextmanager
async def serving(
    urls: list[str], *, admin_key: str | None = None, **server: Any
) -> AsyncIterator[Listeners]:
    """A router on real sockets with these ``server:`` settings (127.0.0.1, free port)."""
    config = router_config(urls, port=0, admin_key=admin_key, server=ServerConfig(**server))
    app = make_app(config)
    listeners = await start_listeners(app, config)
    try:
        yield listeners
    finally:
        await until(lambda: app[STATE].num_in_flight == 0, 5.0)
        assert_no_load(app[STATE])
        await listeners.runner.cleanup()


async def connect(listeners: Listeners) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*listeners.api)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await asyncio.wait_for(reader.readexactly(length), 5.0)


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """What the server still sends before it closes the connection (AssertionError if it
    keeps it open past ``timeout_s``)."""
    data = b""
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        raise AssertionError(f"connection still open after {timeout_s} s") from None
    except ConnectionResetError:
        pass
    return data


async def test_idle_keepalive_connection_is_closed(harness: Harness) -> None:
    b = await harness.backend("b")
    async with serving([b.url], keepalive_s=0.3, header_timeout_s=30, body_timeout_s=30) as ls:
        reader, writer = await connect(ls)
        writer.write(HEALTH)
        assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
        assert await until_closed(reader) == b""
        writer.close()


async def test_slow_headers_are_cut_idle_keepalive_is_not(harness: Harness) -> None:
    b = await harness.backend("b")
    async with serving([b.url], keepalive_s=30, header_timeout_s=0.3, body_timeout_s=30) as ls:
        kept_r, kept_w = await connect(ls)
        kept_w.write(HEALTH)
        assert (await read_response(kept_r)).startswith(b"HTTP/1.1 200")
        silent_r, silent_w = await connect(ls)  # opens and never sends a byte
        partial_r, partial_w = await connect(ls)
        partial_w.write(b"GET /health HTTP/1.1\r\nHost: router\r\n")  # no final blank line
        assert await until_closed(silent_r) == b""
        assert await until_closed(partial_r) == b""
        assert ls.guard.num_header_timeouts == 2
        # the kept-alive connection sat idle longer than header_timeout_s: still served
        kept_w.write(HEALTH)
        assert (await read_response(kept_r)).startswith(b"HTTP/1.1 200")
        for w in (kept_w, silent_w, partial_w):
            w.close()


async def test_slow_body_gets_408_and_is_closed(harness: Harness) -> None:
    b = await harness.backend("b")
    b.state.chunk_delay_s = 0.15  # a stream of ~0.9 s: longer than every timeout below
    b.state.num_chunks = 6
    async with serving([b.url], keepalive_s=30, header_timeout_s=0.3, body_timeout_s=0.3) as ls:
        reader, writer = await connect(ls)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"model": '
        )
        answer = await until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"code":"request_timeout"' in answer
        assert ls.guard.num_body_timeouts == 1
        writer.close()
        # ordinary requests and a stream longer than the timeouts are untouched
        base = f"http://{ls.api[0]}:{ls.api[1]}"
        async with aiohttp.ClientSession() as session:
            body = {"model": "m1", "prompt": "hello"}
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            async with session.post(
                base + "/v1/completions", json={**body, "stream": True}
            ) as resp:
                text = await resp.text()
            assert resp.status == 200 and text.count('"from"') == 6 and "[DONE]" in text


async def test_connections_over_the_cap_get_503_at_once(harness: Harness) -> None:
    b = await harness.backend("b")
    async with serving([b.url], max_client_connections=3) as ls:
        held = [await connect(ls) for _ in range(3)]
        for reader, writer in held:
            writer.write(HEALTH)
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
        reader, writer = await connect(ls)
        answer = await until_closed(reader, 2.0)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        writer.close()
        assert ls.guard.num_refused == {"all": 1}
        held[0][1].close()
        await until(lambda: ls.guard.num_open["all"] == 2)
        reader, writer = await connect(ls)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: router\r\n\r\n")
        metrics = await read_response(reader)
        assert metrics.startswith(b"HTTP/1.1 200")
        assert b'kvroute_client_connections_refused_total{listener="all"} 1.0' in metrics
        assert b'kvroute_client_connections{listener="all"} 3.0' in metrics
        writer.close()
        for _, w in held[1:]:
            w.close()


@pytest.mark.parametrize(
    "scenario",
    [
        test_idle_keepalive_connection_is_closed,
        test_slow_headers_are_cut_idle_keepalive_is_not,
        test_slow_body_gets_408_and_is_closed,
        test_connections_over_the_cap_get_503_at_once,
    ],
)
def test_on_uvloop(scenario: Callable[[Harness], Awaitable[None]]) -> None:
    """The same stories on uvloop, which ``kvroute serve`` runs (its transports are not
    asyncio's classes)."""
    import uvloop

    async def run() -> None:
        harness = Harness()
        try:
            await scenario(harness)
        finally:
            for b in harness.backends:
                await b.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


def test_server_section_from_yaml_and_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "backends: [http://127.0.0.1:8001]\n"
        "server:\n  keepalive_s: 20\n  header_timeout_s: 5\n  max_client_connections: 100\n"
    )
    server = load_config(cfg).server
    assert (server.keepalive_s, server.header_timeout_s, server.body_timeout_s) == (20, 5, 60)
    assert server.max_client_connections == 100
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", str(cfg), "--body-timeout", "7",
                              "--max-client-connections", "50"])  # fmt: skip
    server = config_from_args(args).server
    assert (server.keepalive_s, server.body_timeout_s, server.max_client_connections) == (20, 7, 50)
    cfg.write_text("server:\n  header_timeout_s: 0\n")
    with pytest.raises(ValueError, match=r"server\.header_timeout_s"):
        load_config(cfg)
    cfg.write_text("server:\n  read_timeout: 3\n")
    with pytest.raises(ValueError, match=r"^server\.read_timeout: unknown key"):
        load_config(cfg)


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nx-request-id: a\x7fb\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: r\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"BREW /pot HTTP/1.1\x00\r\n\r\n",
    ],
    ids=["control-byte-in-header", "two-content-lengths", "bad-request-line"],
)
async def test_requests_the_parser_refuses_get_an_openai_error_and_one_log_line(
    harness: Harness, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp answers these itself: text/plain, a traceback at ERROR per request (a log
    flood anyone can cause) and its version in ``Server``."""
    import json

    b = await harness.backend("b")
    async with serving([b.url]) as ls:
        reader, writer = await connect(ls)
        writer.write(raw)
        data = await until_closed(reader)
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), data[:200]
        assert b"Server: kvroute" in head and b"aiohttp" not in head
        assert json.loads(body)["error"]["code"] == "bad_http_request"
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        reader, writer = await connect(ls)  # the listener still serves
        writer.write(HEALTH)
        served = await read_response(reader)
        assert served.startswith(b"HTTP/1.1 200") and b"Server: kvroute" in served
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status", "said"),
    [
        (
            b"GET /health HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
            b"431",
            b"longer",
        ),
        (b"GET /" + b"u" * 9000 + b" HTTP/1.1\r\nHost: r\r\n\r\n", b"414", b"request target"),
        (
            b"GET /health HTTP/1.1\r\nHost: r\r\n"
            + b"".join(b"X-%d: v\r\n" % i for i in range(200))
            + b"\r\n",
            b"431",
            b"too many header fields",
        ),
    ],
    ids=["long-header", "long-request-line", "many-headers"],
)
async def test_oversized_headers_get_431_and_a_long_url_414_without_their_bytes_echoed(
    harness: Harness, raw: bytes, status: bytes, said: bytes
) -> None:
    """They were a 400 whose message quoted the first 100 bytes the client sent; a URL
    over the line limit has a status of its own (RFC 9110 section 15.5.15)."""
    b = await harness.backend("b")
    async with serving([b.url]) as ls:
        reader, writer = await connect(ls)
        writer.write(raw)
        data = await until_closed(reader)
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == status, data[:200]
    assert said in body and b"aaaa" not in body and b"uuuu" not in body
    code = b"header_fields_too_large" if status == b"431" else b"uri_too_long"
    assert b'"code":"%s"' % code in body
