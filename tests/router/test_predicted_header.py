"""``x-kvroute-predicted-cached-tokens``: the hit the router expected, on every answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvroute.core.policy.base import Decision, Reason, RouteRequest
from kvroute.router.app import make_app
from kvroute.router.state import STATE, RouterState
from kvroute.sim.server import SimFleet, start_fleet
from tests.router.conftest import Harness, assert_no_load, router_config

BODY = {"model": "m1", "prompt": "hello", "max_tokens": 4}
PREDICTED = "x-kvroute-predicted-cached-tokens"
LEFT = "x-kvroute-left-cached-tokens"
PROMPT = "You are a helpful assistant. " * 20


async def test_every_answer_carries_the_predicted_cached_tokens(harness: Harness) -> None:
    """Whole answers and streams alike (fake engines: nothing cached yet, 0)."""
    a = await harness.backend("a")
    client = await harness.router([a.url], assemble_non_streaming=False)
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status == 200 and resp.headers[PREDICTED] == "0"
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status == 200 and resp.headers[PREDICTED] == "0"
    await resp.read()


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = await start_fleet(2, profile="tiny", speedup=100.0)
    yield fleet
    await fleet.close()


async def test_predicted_cached_tokens_follow_the_dispatch_and_a_retry(sim: SimFleet) -> None:
    """On the simulated vLLM: the header is the hit the router counted for the backend
    that answered (kvroute_predicted_cached_tokens_total), for an assembled answer and a
    stream; a retry reports what its new backend holds, not the first pick's."""
    app = make_app(router_config(sim.urls, policy="prefix"))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    state: RouterState = client.app[STATE]  # type: ignore[index]

    def counted(url: str) -> float:
        name = "kvroute_predicted_cached_tokens_total"
        return state.metrics.registry.get_sample_value(name, {"backend": url}) or 0.0

    async def ask(question: str, *, stream: bool = False) -> tuple[str, str, int, int]:
        """(backend, decision, header value, engine-reported cached tokens)"""
        body: dict[str, Any] = {"prompt": PROMPT + question, "max_tokens": 2}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        before = {u: counted(u) for u in sim.urls}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        if stream:
            events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: {")]
            usage = next(json.loads(e)["usage"] for e in reversed(events) if '"usage"' in e)
        else:
            usage = (await r.json())["usage"]
        url, predicted = r.headers["x-kvroute-backend"], int(r.headers[PREDICTED])
        assert predicted == counted(url) - before[url]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return url, r.headers["x-kvroute-decision"], predicted, cached

    try:
        home, reason, predicted, cached = await ask(" one")
        assert (reason, predicted, cached) == ("cold", 0, 0)
        _, reason, predicted, cached = await ask(" two")
        assert reason == "prefix" and predicted > 0 and cached > 0
        _, reason, predicted, cached = await ask(" three", stream=True)
        assert reason == "prefix" and predicted > 0 and cached > 0
        sim.backends[sim.urls.index(home)].faults.error_status = 503
        before_home = counted(home)
        other, reason, predicted, cached = await ask(" four")
        assert (other != home, reason) == (True, "retry")
        assert counted(home) > before_home  # the first pick was predicted a hit ...
        assert predicted == cached == 0  # ... the backend that answered holds nothing
    finally:
        assert_no_load(state)
        await client.close()


async def test_a_diverted_answer_says_what_it_left_at_home(harness: Harness) -> None:
    """A request moved away from its prefix's holder (a holder with 5 s of prefill
    queued) carries the hit predicted there, and kvroute_left_cached_tokens_total counts
    it; an answer that was not moved carries no such header."""
    a, b = await harness.backend("a"), await harness.backend("b")
    client = await harness.router([a.url, b.url], policy="prefix")
    state = harness.state(client)

    def counted() -> float:
        return state.metrics.registry.get_sample_value("kvroute_left_cached_tokens_total") or 0.0

    first = await client.post("/v1/completions", json={**BODY, "prompt": PROMPT + "one"})
    assert first.status == 200 and LEFT not in first.headers
    holder = first.headers["x-kvroute-backend"]
    busy = RouteRequest("busy", "m1", (1,), 50_000, 1)
    ticket = state.fleet.dispatch(Decision(holder, Reason.LOAD, 0, (holder,)), busy, state.clock())
    try:
        moved = await client.post("/v1/completions", json={**BODY, "prompt": PROMPT + "two"})
        assert moved.status == 200
        assert moved.headers["x-kvroute-decision"] == "load"
        assert moved.headers["x-kvroute-backend"] != holder
        left = int(moved.headers[LEFT])
        assert left > 0 and int(moved.headers[PREDICTED]) < left
        assert counted() == left
    finally:
        state.fleet.finish(ticket, state.clock(), ok=True)
    assert_no_load(state)
