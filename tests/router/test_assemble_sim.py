"""Non-streaming clients on the simulated vLLM engines (issue 10, deliverable 1).

The simulator's model card says ``owned_by: vllm``, so a non-streaming request goes to it
as a stream and comes back assembled. Its answer must be the engine's own whole answer
(id and created aside), and the prefill rate the router learns from non-streaming
traffic must be the one it learns from the same traffic streamed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from random import Random
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvroute.common.tokenizer import OUTPUT_WORDS
from kvroute.core.backend import BackendState
from kvroute.router.app import make_app
from kvroute.router.state import STATE
from kvroute.sim.profiles import get_profile
from kvroute.sim.server import SimFleet, start_fleet
from tests.router.conftest import assert_no_load, router_config

PROMPT = "You are a helpful assistant. Answer in one word. " * 12


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = await start_fleet(1, profile="tiny", speedup=100.0)
    yield fleet
    await fleet.close()


async def _router(urls: list[str], **changes: Any) -> TestClient[Any, Any]:
    client = TestClient(TestServer(make_app(router_config(urls, **changes)), host="127.0.0.1"))
    await client.start_server()
    return client


def _stable(body: dict[str, Any]) -> str:
    """The answer without what differs per call (id, created), as ordered JSON."""
    return json.dumps({k: v for k, v in body.items() if k not in ("id", "created")})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 7},
        ),
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "seed": 11}),
    ],
)
async def test_assembled_answer_is_the_engines_own_whole_answer(
    sim: SimFleet, path: str, body: dict[str, Any]
) -> None:
    client = await _router(sim.urls)
    try:
        async with aiohttp.ClientSession() as s:

            async def direct() -> dict[str, Any]:
                async with s.post(sim.urls[0] + path, json=body) as r:
                    assert r.status == 200
                    return await r.json()

            await direct()  # the prefix is cached: both answers below report the same hit
            resp = await client.post(path, json=body)
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/json")
            via = await resp.json()
            own = await direct()
        assert _stable(via) == _stable(own)  # same fields, same order, same values
        assert via["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        (bs,) = client.app[STATE].fleet.backend_states()  # type: ignore[index]
        assert bs.num_reported == 1  # the usage chunk was read
    finally:
        assert_no_load(client.app[STATE])  # type: ignore[index]
        await client.close()


# A profile whose prefill is slow enough to time on a busy machine: 1,000 tokens take
# ~40 ms, and 150 output tokens another ~150 ms, so a whole answer takes ~4x its TTFT.
SLOW_PREFILL = dataclasses.replace(
    get_profile("tiny"), name="tiny-slow-prefill", b_ms_per_token=0.04
)
NUM_REQUESTS = 6


def _prompt(i: int) -> str:
    rng = Random(i)
    return f"request {i}:" + "".join(" " + rng.choice(OUTPUT_WORDS) for _ in range(1000))


async def _learn(stream: bool) -> BackendState:
    """What the router learned from NUM_REQUESTS distinct prompts sent one by one."""
    sim = await start_fleet(1, profile=SLOW_PREFILL, speedup=1.0, model_name="tiny")
    client = await _router(sim.urls)
    try:
        for i in range(NUM_REQUESTS):
            body = {"model": "tiny", "prompt": _prompt(i), "max_tokens": 150, "stream": stream}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            await resp.read()
        (bs,) = client.app[STATE].fleet.backend_states()  # type: ignore[index]
        return bs
    finally:
        assert_no_load(client.app[STATE])  # type: ignore[index]
        await client.close()
        await sim.close()


async def test_non_streaming_traffic_teaches_the_prefill_rate_streaming_traffic_does() -> None:
    """Issue 10: before, a whole answer's time was taken for its TTFT, and the rate learned
    from non-streaming traffic was ~4x too slow here (and ~10x on longer answers)."""
    streamed, whole = await asyncio.gather(_learn(stream=True), _learn(stream=False))
    assert streamed.rate_samples == whole.rate_samples == NUM_REQUESTS
    ratio = whole.prefill_tokens_per_s / streamed.prefill_tokens_per_s
    assert 1 / 1.5 < ratio < 1.5, (whole.prefill_tokens_per_s, streamed.prefill_tokens_per_s)
