"""Malformed requests: each gets the right 4xx in the OpenAI shape; the router stays up."""

from __future__ import annotations

import logging

import pytest

from kvroute.router.config import LimitConfig
from tests.router.conftest import Harness

CASES = [
    # (name, method, path, body, status, code)
    ("bad json", "POST", "/v1/completions", b"{not json", 400, "bad_request"),
    ("empty body", "POST", "/v1/completions", b"", 400, "bad_request"),
    ("body is a list", "POST", "/v1/completions", b"[1, 2]", 400, "bad_request"),
    ("body is a string", "POST", "/v1/chat/completions", b'"hi"', 400, "bad_request"),
    ("missing prompt", "POST", "/v1/completions", b'{"model": "m1"}', 400, "bad_request"),
    ("missing messages", "POST", "/v1/chat/completions", b'{"model": "m1"}', 400, "bad_request"),
    ("empty messages", "POST", "/v1/chat/completions", b'{"messages": []}', 400, "bad_request"),
    (
        "messages not a list",
        "POST",
        "/v1/chat/completions",
        b'{"messages": "hi"}',
        400,
        "bad_request",
    ),
    ("prompt is a number", "POST", "/v1/completions", b'{"prompt": 5}', 400, "bad_request"),
    (
        "model not a string",
        "POST",
        "/v1/completions",
        b'{"model": 1, "prompt": "x"}',
        400,
        "bad_request",
    ),
    (
        "stream not a bool",
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "stream": "yes"}',
        400,
        "bad_request",
    ),
    (
        "max_tokens negative",
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": -1}',
        400,
        "bad_request",
    ),
    ("not utf-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "bad_request"),
    (
        "oversized body",
        "POST",
        "/v1/completions",
        b'{"prompt": "' + b"a" * 5000 + b'"}',
        413,
        "request_too_large",
    ),
    ("unknown path", "POST", "/v1/embeddings", b"{}", 404, "not_found"),
    ("unknown get path", "GET", "/nope", b"", 404, "not_found"),
    ("wrong method", "GET", "/v1/completions", b"", 405, "method_not_allowed"),
    (
        "unknown model",
        "POST",
        "/v1/completions",
        b'{"model": "zz", "prompt": "x"}',
        404,
        "model_not_found",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_malformed_request_gets_openai_error(
    harness: Harness, method: str, path: str, body: bytes, status: int, code: str
) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], limits=LimitConfig(max_body_bytes=4096))
    resp = await client.request(method, path, data=body)
    assert resp.status == status
    payload = await resp.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert payload["error"]["code"] == code
    assert payload["error"]["message"]
    assert resp.headers["x-request-id"]  # errors are traced like answers
    assert not b.state.requests  # nothing malformed reached the backend
    ok = await client.post("/v1/completions", data=b'{"model": "m1", "prompt": "x"}')
    assert ok.status == 200  # the router is still healthy
    metrics = await client.get("/metrics")
    assert f'status="{status}"' in await metrics.text()


async def test_errors_carry_the_request_id_and_5xx_are_logged_with_it(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed request is traced like an answered one: the client's x-request-id (or
    one of the router's) comes back, and the log line of a 5xx names it."""
    b = await harness.backend("a")
    client = await harness.router([b.url])
    mine = {"x-request-id": "client-xyz-1"}
    for path, body in (("/v1/completions", b"{"), ("/v1/nowhere", b"{}")):
        resp = await client.post(path, data=body, headers=mine)
        assert resp.status in (400, 404) and resp.headers["x-request-id"] == "client-xyz-1"
    resp = await client.post("/v1/completions", data=b"{")
    assert resp.headers["x-request-id"]  # one of ours
    await b.close()  # the only backend refuses connections now: a 502
    caplog.set_level(logging.WARNING, logger="kvroute.router")
    body = b'{"model": "m1", "prompt": "x"}'
    resp = await client.post("/v1/completions", data=body, headers=mine)
    assert resp.status in (502, 503) and resp.headers["x-request-id"] == "client-xyz-1"
    assert any(
        r.getMessage().startswith(f"request client-xyz-1: {resp.status} ") for r in caplog.records
    )


async def test_an_endpoint_the_router_does_not_serve_says_which_it_does(
    harness: Harness,
) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.post("/v1/embeddings", json={"model": "m1", "input": "x"})
    assert resp.status == 404
    message = (await resp.json())["error"]["message"]
    assert "/v1/embeddings" in message and "/v1/chat/completions" in message
