"""Engines other than vLLM, as their servers really answer (sources in each test):
kvroute must probe, retry, read usage and end streams right with each."""

from __future__ import annotations

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
