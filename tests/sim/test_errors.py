"""Malformed requests get vLLM's error JSON and status, and never reach the engine."""

from __future__ import annotations

import pytest

from tests.sim.helpers import scrape

LONG = " ".join(["word"] * 8200)  # more tokens than tiny's max_model_len (8192)

# (name, path, raw body, status, param)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "x"', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("prompt wrong type", "/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("empty prompt", "/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("empty token list", "/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("token not int", "/v1/completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
    ("token out of vocab", "/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),
    ("batch of two", "/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("zero max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400,
     "max_tokens"),
    ("float max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": 2.5}', 400,
     "max_tokens"),
    ("string max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": "4"}', 400,
     "max_tokens"),
    ("bool max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": true}', 400,
     "max_tokens"),
    ("stream not bool", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("stream_options without stream", "/v1/completions",
     b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("n > 1", "/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("unknown model", "/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
    ("model not a string", "/v1/completions", b'{"prompt": "x", "model": 7}', 400, "model"),
    ("prompt too long", "/v1/completions", b'{"prompt": "' + LONG.encode() + b'"}', 400,
     "messages"),
    ("max_tokens past context", "/v1/completions", b'{"prompt": "x", "max_tokens": 8192}', 400,
     "max_tokens"),
    ("missing messages", "/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("messages not a list", "/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("bad role", "/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}',
     400, "messages"),
    ("chat unknown model", "/v1/chat/completions",
     b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ("chat zero max_completion_tokens", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "raw", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
async def test_bad_request_gets_vllm_error(fleet, session, name, path, raw, status, param):
    url = fleet.urls[0]
    async with session.post(url + path, data=raw,
                            headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        assert resp.status == status
        body = (await resp.json())["error"]  # vLLM's envelope, as OpenAI's
    assert body["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert body["code"] == status and body["param"] == param
    assert isinstance(body["message"], str) and body["message"]
    metrics = await scrape(session, url)
    assert metrics["vllm:prefix_cache_queries_total"] == 0  # the engine never saw it
