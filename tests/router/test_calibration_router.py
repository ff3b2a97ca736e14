"""Approximate mode learns the engines' bytes per token from their usage (issue 10,
deliverable 2): real HTTP on loopback, a backend whose tokenizer counts 3 bytes per token.

Before, the router counted 4 bytes per token whatever the engine's tokenizer: prompts
were estimated at 3/4 of their tokens, and each engine's cache model held 4/3 of what
the engine holds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvroute.router.scraper import scrape
from tests.router.assemble_helpers import VllmLike
from tests.router.conftest import Harness

CACHE_INFO = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
PROMPT = "Explain prefix caching to a new engineer, step by step. " * 50  # 2,850 bytes


@pytest.fixture
async def vllm(harness: Harness) -> AsyncIterator[VllmLike]:
    backend = await VllmLike().start()
    backend.script.bytes_per_token = 3.0
    backend.script.metrics_text = CACHE_INFO
    yield backend
    await backend.close()


def _routed_prompt_tokens(harness: Harness, client: Any, url: str) -> float:
    registry = harness.state(client).metrics.registry
    value = registry.get_sample_value("kvroute_routed_prompt_tokens_total", {"backend": url})
    return value or 0.0


@pytest.mark.parametrize(
    ("owned_by", "stream"),
    [
        ("vllm", False),  # assembled: usage from the stream's usage chunk
        ("other", False),  # forwarded whole: usage from the answer
        ("vllm", True),  # a streaming client that asked for usage
    ],
)
async def test_estimates_and_capacity_follow_the_engines_bytes_per_token(
    harness: Harness, vllm: VllmLike, owned_by: str, stream: bool
) -> None:
    vllm.script.owned_by = owned_by
    client = await harness.router([vllm.url])
    state = harness.state(client)
    for rt in state.backends:
        await scrape(state, rt)
    (before,) = state.fleet.backend_states()
    assert (before.capacity_blocks, before.key_capacity_blocks) == (1000, 1000)
    assert before.bytes_per_token == 4.0

    async def ask(i: int) -> None:
        body: dict[str, Any] = {"model": "m1", "prompt": f"question {i}: {PROMPT}"}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        resp = await client.post("/v1/completions", data=json.dumps(body).encode())
        assert resp.status == 200
        await resp.read()

    for i in range(6):
        await ask(i)
    (after,) = state.fleet.backend_states()
    assert after.bytes_per_token == pytest.approx(3.0, rel=0.01)
    # 1000 engine blocks of 16 tokens hold 750 key blocks of 64 bytes (21.3 tokens each)
    assert after.capacity_blocks == 1000
    assert after.key_capacity_blocks == pytest.approx(750, abs=8)
    counted = _routed_prompt_tokens(harness, client, vllm.url)
    await ask(99)
    num_bytes = len(f"question 99: {PROMPT}".encode())
    estimate = _routed_prompt_tokens(harness, client, vllm.url) - counted
    assert estimate == pytest.approx(num_bytes / 3, rel=0.01)  # the engine's count, ~950


async def test_a_stream_without_usage_teaches_nothing(harness: Harness, vllm: VllmLike) -> None:
    client = await harness.router([vllm.url])
    for i in range(6):
        body = {"model": "m1", "prompt": f"question {i}: {PROMPT}", "stream": True}
        resp = await client.post("/v1/completions", data=json.dumps(body).encode())
        assert resp.status == 200
        await resp.read()
    assert harness.state(client).fleet.backend_states()[0].bytes_per_token == 4.0
    assert harness.state(client).fleet.calibration.pooled.num_samples == 0
