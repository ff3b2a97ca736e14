"""Helpers shared by the request-hardening tests (not a test module)."""

from __future__ import annotations

import socket
from typing import Any

OK_BODY = {"model": "m1", "prompt": "hello"}


def dead_url() -> str:
    """A loopback URL nothing listens on (a backend down since the router started)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def assert_bad_request(resp: Any, needle: str) -> None:
    """A 400 in the OpenAI error shape whose message contains ``needle``."""
    assert resp.status == 400, await resp.text()
    payload = await resp.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == "bad_request"
    assert needle in payload["error"]["message"]


async def assert_still_serves(client: Any) -> None:
    """A plain request is answered and /metrics renders."""
    ok = await client.post("/v1/completions", json=OK_BODY)
    assert ok.status == 200
    metrics = await client.get("/metrics")
    assert metrics.status == 200
