"""The router in front of the real simulated vLLM backends (kvroute.sim)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvroute.router.app import make_app
from kvroute.router.scraper import scrape
from kvroute.router.state import STATE
from kvroute.sim.server import SimFleet, start_fleet
from tests.router.conftest import assert_no_load, router_config

PROMPT = "You are a helpful assistant. " * 20


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = await start_fleet(2, profile="tiny", speedup=100.0)
    yield fleet
    await fleet.close()


@pytest.fixture
async def router(sim: SimFleet) -> AsyncIterator[TestClient[Any, Any]]:
    client = TestClient(TestServer(make_app(router_config(sim.urls)), host="127.0.0.1"))
    await client.start_server()
    yield client
    assert_no_load(client.app[STATE])  # type: ignore[index]
    await client.close()


def _stable(body: dict[str, Any]) -> dict[str, Any]:
    """A completion without the fields that differ per call (id, created)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def test_non_streaming_matches_direct(sim: SimFleet, router: TestClient[Any, Any]) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6}
    resp = await router.post("/v1/completions", json=body)
    assert resp.status == 200
    via = await resp.json()
    backend = resp.headers["x-kvroute-backend"]
    async with aiohttp.ClientSession() as s, s.post(backend + "/v1/completions", json=body) as r:
        direct = await r.json()
    assert _stable(via)["choices"] == _stable(direct)["choices"]
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefix now cached


async def test_streaming_through_router(router: TestClient[Any, Any]) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "stream": True,
    }
    resp = await router.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_scraper_reads_sim_metrics(sim: SimFleet, router: TestClient[Any, Any]) -> None:
    state = router.app[STATE]  # type: ignore[index]
    for _ in range(4):
        r = await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status == 200  # no model: the only served model is used
    for rt in state.backends:
        await scrape(state, rt)
    states = state.fleet.backend_states()
    assert {s.block_size for s in states} == {16}
    assert {s.capacity_blocks for s in states} == {sim.backends[0].profile.num_gpu_blocks}
    for _ in range(4):
        await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    for rt in state.backends:
        await scrape(state, rt)  # second scrape: counter deltas since the first
    states = state.fleet.backend_states()
    assert sum(s.engine_query_tokens for s in states) > 0
    assert sum(s.engine_hit_tokens for s in states) > 0  # the shared prefix hit


async def test_sim_faults_fail_over_and_midstream_drop(
    sim: SimFleet, router: TestClient[Any, Any]
) -> None:
    sim.backends[0].faults.error_status = 503
    for _ in range(4):
        r = await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status == 200
        assert r.headers["x-kvroute-backend"] == sim.urls[1]
    sim.backends[0].faults.clear()
    sim.backends[1].faults.drop_after_chunks = 2
    sim.backends[0].faults.drop_after_chunks = 2
    body = {"prompt": PROMPT, "max_tokens": 20, "stream": True}
    r = await router.post("/v1/completions", json=body)
    text = await r.text()
    assert r.status == 200
    assert '"error"' in text and text.endswith("data: [DONE]\n\n")


async def test_prefix_policy_sticks_to_the_cache_holder(sim: SimFleet) -> None:
    client = TestClient(
        TestServer(make_app(router_config(sim.urls, policy="prefix")), host="127.0.0.1")
    )
    await client.start_server()
    try:
        seen, reasons = set(), []
        for i in range(4):
            body = {"prompt": PROMPT + f" question {i}", "max_tokens": 2}
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200
            seen.add(r.headers["x-kvroute-backend"])
            reasons.append(r.headers["x-kvroute-decision"])
        assert len(seen) == 1  # the shared prefix keeps them on one replica
        assert reasons[-1] == "prefix"
        text = await (await client.get("/metrics")).text()
        assert "kvroute_backend_predicted_hit_rate" in text
    finally:
        assert_no_load(client.app[STATE])  # type: ignore[index]
        await client.close()


async def test_cache_salt_separates_keys_as_the_engine_does(sim: SimFleet) -> None:
    """vLLM (and the simulator) mix ``cache_salt`` into the first block: the router must
    not predict a hit across salts, and must predict one within a salt."""
    client = TestClient(
        TestServer(make_app(router_config(sim.urls, policy="prefix")), host="127.0.0.1")
    )
    await client.start_server()

    async def ask(question: str, salt: str | None) -> tuple[str, int]:
        body: dict[str, Any] = {"prompt": PROMPT + question, "max_tokens": 2}
        if salt is not None:
            body["cache_salt"] = salt
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        return r.headers["x-kvroute-decision"], cached

    try:
        assert await ask(" one", "tenant-a") == ("cold", 0)
        assert await ask(" two", None) == ("cold", 0)  # same text, no salt: no hit
        assert await ask(" three", "tenant-b") == ("cold", 0)
        decision, cached = await ask(" four", "tenant-a")
        assert decision == "prefix" and cached > 0  # same salt: the engine hits too
    finally:
        assert_no_load(client.app[STATE])  # type: ignore[index]
        await client.close()
