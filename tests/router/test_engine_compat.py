"""Engines other than vLLM, as their servers really answer (sources in each test):
kvroute must probe, retry, read usage and end streams right with each."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.router.conftest import Harness

BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 2}'


async def test_an_engine_without_health_is_healthy_by_its_model_list(harness: Harness) -> None:
    """Ollama has no /health (gin's 404; ollama server/routes.go): its /v1/models answering
    is the health signal, else every request got 503."""
    b = await harness.backend("ollama")
    b.state.health_status = 404
    client = await harness.router([b.url])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert (await client.get("/health")).status == 200


async def test_an_overloaded_429_is_retried_on_another_backend_like_a_503(
    harness: Harness,
) -> None:
    """TGI answers a full replica 429 {"error": "Model is overloaded", "error_type":
    "overloaded"} (router/src/server.rs): another replica may have room."""
    full, free = await harness.backend("full"), await harness.backend("free")
    full.state.fail_status, full.state.fail_retry_after = 429, "2"
    client = await harness.router([full.url, free.url])
    for _ in range(4):  # round-robin: half of them start on the full one
        resp = await client.post("/v1/completions", data=BODY)
        assert resp.status == 200 and resp.headers["x-kvroute-backend"] == free.url
    assert len(full.state.requests) == 2 and len(free.state.requests) == 4
    free.state.fail_status, free.state.fail_retry_after = 429, "2"
    resp = await client.post("/v1/completions", data=BODY)  # every replica full
    assert resp.status == 503 and resp.headers["Retry-After"] == "2"
    assert "answered 429" in (await resp.json())["error"]["message"]


@pytest.fixture
async def canned(engine: Any) -> Any:
    """Starts loopback engines answering POSTs with the given JSON answers in turn."""

    async def start(answers: list[dict[str, Any]]) -> str:
        queue = list(answers)

        async def answer(request: web.Request) -> web.Response:
            return web.json_response(queue.pop(0))

        url, _ = await engine(answer)
        return str(url)

    return start


def _answer(usage: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "ok", "finish_reason": "length"}
    return {"object": "text_completion", "choices": [choice], "usage": usage, **extra}


async def _reported(harness: Harness, client: Any, url: str, n: int) -> tuple[int, int]:
    for i in range(n):  # ~500 tokens by the router's estimate: the counts are under it
        body = {"model": "m1", "prompt": f"{i} " + "hello " * 300, "max_tokens": 2}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
    (fs,) = [s for s in harness.state(client).fleet.backend_states() if s.url == url]
    return fs.num_reported, fs.reported_hit_tokens


async def test_sglang_leaves_out_a_zero_cached_count_and_it_is_read_as_a_miss(
    canned: Any, harness: Harness
) -> None:
    """SGLang with --enable-cache-report sends prompt_tokens_details only when cached > 0
    (entrypoints/openai/usage_processor.py): the misses must count, or the reported hit
    rate is the hits' alone."""
    plain = {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302}
    hit = {**plain, "prompt_tokens_details": {"cached_tokens": 288}}
    url = await canned([_answer(plain), _answer(hit), _answer(plain), _answer(hit)])
    client = await harness.router([url])
    # the first miss comes before the backend showed it reports counts: not counted
    assert await _reported(harness, client, url, 4) == (3, 576)


async def test_llama_cpp_timings_cache_n_is_its_cached_count(canned: Any, harness: Harness) -> None:
    """llama.cpp before PR #19361 gave the cached prompt tokens only as timings.cache_n
    (tools/server/server-task.cpp)."""
    plain = {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302}
    url = await canned([_answer(plain, timings={"cache_n": 277, "prompt_n": 23})])
    client = await harness.router([url])
    assert await _reported(harness, client, url, 1) == (1, 277)
