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
