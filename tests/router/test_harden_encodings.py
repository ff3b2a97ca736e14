"""Bodies in a content encoding the router cannot decode are the client's error, and the
admin API checks its fields' types (a new user's review, fifteenth session).

A body labelled gzip that does not inflate got 500 ("internal router error") from
aiohttp's parser; ``br`` and ``zstd`` got a 400 asking to install a module on the
server. ``POST /admin/backends`` with a non-string url got 500 (AttributeError), and an
object as api_key was accepted.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
import zlib

import pytest

from kvroute.router.app import make_app
from kvroute.router.body import inflate
from kvroute.router.config import LimitConfig
from kvroute.router.errors import BadRequest, PayloadTooLarge
from kvroute.router.listener import start_listeners
from tests.router.conftest import Harness, assert_no_load, router_config
from tests.router.harden_request_helpers import assert_bad_request, assert_still_serves
from tests.router.test_harden_server import connect, read_response, serving

ADMIN = "admin-key-123"
KEY = {"Authorization": f"Bearer {ADMIN}"}
BODY = b'{"model": "m1", "prompt": "hello"}'


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "GZIP"])
async def test_a_body_that_does_not_inflate_is_400(harness: Harness, encoding: str) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/completions", data=BODY, headers=headers)
    await assert_bad_request(resp, "content-encoding")
    assert not b.state.requests
    assert_no_load(harness.state(client))
    await assert_still_serves(client)


@pytest.mark.parametrize("encoding", ["compress", "gzip, br", "identity-ish"])
async def test_an_encoding_the_router_cannot_decode_is_415(harness: Harness, encoding: str) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/completions", data=b"\x00\x01binary", headers=headers)
    assert resp.status == 415, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert "identity, gzip or deflate" in error["message"] and "install" not in error["message"]
    assert not b.state.requests
    await assert_still_serves(client)


@pytest.mark.parametrize(
    ("encoding", "pack"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
async def test_a_compressed_body_is_routed(harness: Harness, encoding: str, pack: object) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    resp = await client.post("/v1/completions", data=pack(BODY), headers=headers)  # type: ignore[operator]
    assert resp.status == 200, await resp.text()
    assert len(b.state.requests) == 1


async def test_admin_add_with_a_bad_gzip_body_is_400(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], admin_key=ADMIN)
    headers = {**KEY, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = await client.post("/admin/backends", data=b'{"url": "http://x:1"}', headers=headers)
    await assert_bad_request(resp, "content-encoding")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"url": 5}, "backend.url: expected a string"),
        ({"url": None}, "backend.url: expected a string"),
        ({"url": ["http://127.0.0.1:9"]}, "backend.url: expected a string"),
        ({}, "backend.url: missing"),
        ({"url": "http://127.0.0.1:9", "api_key": {"x": 1}}, "backend.api_key: expected a string"),
        ({"url": "http://127.0.0.1:9", "weight": True}, "backend.weight: expected a number"),
        ({"url": "http://127.0.0.1:9", "weight": 0}, "backend.weight: must be in (0, 100]"),
        # a consistent-hash ring holds virtual_nodes x weight points: 1e6 froze the router
        ({"url": "http://127.0.0.1:9", "weight": 1e6}, "backend.weight: must be in (0, 100]"),
        ({"url": "http://127.0.0.1:9", "colour": "red"}, "backend.colour: unknown key"),
    ],
)
async def test_admin_add_names_a_mistyped_field(
    harness: Harness, body: dict[str, object], needle: str
) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], admin_key=ADMIN)
    resp = await client.post("/admin/backends", json=body, headers=KEY)
    await assert_bad_request(resp, needle)
    rows = (await (await client.get("/admin/backends", headers=KEY)).json())["backends"]
    assert [r["url"] for r in rows] == [b.url]  # nothing was added
    await assert_still_serves(client)


@pytest.mark.parametrize("encoding", ["br", "zstd"])
async def test_the_listener_answers_415_for_encodings_its_parser_refuses(
    harness: Harness, encoding: str
) -> None:
    """On the real listeners aiohttp's parser refuses br and zstd before any handler runs
    (its answer asked to install a module); the listener's own error path says 415."""
    b = await harness.backend("a")
    async with serving([b.url]) as listeners:
        reader, writer = await connect(listeners)
        body = b"\x00\x01binary"
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        head, _, payload = (await read_response(reader)).partition(b"\r\n\r\n")
        writer.close()
    assert head.split(b" ", 2)[1] == b"415", head  # HTTP/1.0: the connection closes
    error = json.loads(payload)["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert "install" not in error["message"]
    assert not b.state.requests


def _bomb(size: int) -> bytes:
    """``size`` zero bytes gzipped (about 1,000:1)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * (1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


async def test_a_gzip_bomb_is_413_with_memory_bounded_by_the_limit(harness: Harness) -> None:
    """aiohttp's parser inflated received chunks whole before its size check: a 1 MB
    gzip of 1 GB took the router up 220 MB before the 413 (32 MiB limit). Measured in
    this process (the router on its real listeners) by tracemalloc's peak: 72 MB before,
    16 MB now, for an 8 MiB limit."""
    b = await harness.backend("a")
    limit = 8 << 20
    config = router_config([b.url], port=0, limits=LimitConfig(max_body_bytes=limit))
    app = make_app(config)
    listeners = await start_listeners(app, config)
    bomb = _bomb(256 << 20)  # 256 KB on the wire
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb)
    )
    tracemalloc.start()
    try:
        reader, writer = await asyncio.open_connection(*listeners.api)
        writer.write(head + bomb)
        answer = await read_response(reader)
        writer.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        await listeners.runner.cleanup()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"once decoded" in answer
    assert peak < 3 * limit, f"peak {peak >> 20} MB for a {limit >> 20} MB limit"
    assert not b.state.requests


def test_inflate_reads_gzip_members_and_both_deflates_and_stops_at_the_limit() -> None:
    text = b'{"prompt": "' + b"ab" * 5000 + b'"}'
    assert inflate(gzip.compress(text[:100]) + gzip.compress(text[100:]), "gzip", 1 << 20) == text
    assert inflate(zlib.compress(text), "deflate", 1 << 20) == text
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert inflate(raw.compress(text) + raw.flush(), "deflate", 1 << 20) == text
    with pytest.raises(PayloadTooLarge):
        inflate(gzip.compress(text), "gzip", len(text) - 1)
    assert inflate(gzip.compress(text), "x-gzip", len(text)) == text
    with pytest.raises(BadRequest):
        inflate(gzip.compress(text)[:-9], "gzip", 1 << 20)  # cut short
    with pytest.raises(BadRequest):
        inflate(gzip.compress(text) + b"junk", "gzip", 1 << 20)
