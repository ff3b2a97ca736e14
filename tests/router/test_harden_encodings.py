"""Bodies in a content encoding the router cannot decode are the client's error, and the
admin API checks its fields' types (a new user's review, fifteenth session).

A body labelled gzip that does not inflate got 500 ("internal router error") from
aiohttp's parser; ``br`` and ``zstd`` got a 400 asking to install a module on the
server. ``POST /admin/backends`` with a non-string url got 500 (AttributeError), and an
object as api_key was accepted.
"""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from tests.router.conftest import Harness, assert_no_load
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
