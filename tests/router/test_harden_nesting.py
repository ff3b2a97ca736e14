"""Deeply nested JSON bodies get a 400, not a 500 (issue 9, finding 11)."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.router.errors import BadRequest
from kvroute.router.request import MAX_JSON_DEPTH, parse_completion
from tests.router.conftest import Harness
from tests.router.harden_request_helpers import (
    assert_bad_request,
    assert_still_serves,
)

# -- finding 11: deeply nested JSON ------------------------------------------------------


@pytest.mark.parametrize("depth", [200, 5_000, 100_000])
async def test_deeply_nested_body_is_a_400_not_a_500(harness: Harness, depth: int) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    nested = b"[" * depth + b"]" * depth
    for path, head in (
        ("/v1/completions", b'{"model": "m1", "prompt": "x", "extra": '),
        ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": '),
    ):
        tail = b"}" if path == "/v1/completions" else b"}]}"
        resp = await client.post(path, data=head + nested + tail)
        await assert_bad_request(resp, "nested")
    assert not b.state.requests
    await assert_still_serves(client)


async def test_a_real_tool_schema_nests_well_within_the_limit(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    schema: dict[str, Any] = {"type": "string"}
    for i in range(40):  # 40 levels of object-in-object: deeper than real schemas go
        schema = {"type": "object", "properties": {f"f{i}": schema}}
    tools = [{"type": "function", "function": {"name": "t", "parameters": schema}}]
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200


def test_the_depth_limit_is_exact() -> None:
    """The body object is level 1; MAX_JSON_DEPTH levels pass, one more does not."""

    def body(depth: int) -> bytes:
        inner = depth - 1  # levels below the body object
        return b'{"prompt": "x", "a": ' + b"[" * inner + b"]" * inner + b"}"

    parse_completion(body(MAX_JSON_DEPTH), chat=False)
    with pytest.raises(BadRequest, match="nested"):
        parse_completion(body(MAX_JSON_DEPTH + 1), chat=False)
    # brackets inside strings do not count
    parse_completion(b'{"prompt": "' + b"[{" * 5000 + b'"}', chat=False)
