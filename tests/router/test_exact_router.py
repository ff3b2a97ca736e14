"""The router in exact mode (routing on the engines' own KV events) in front of a 2-backend
simulated fleet that publishes KV events."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, with_kv_endpoints
from kvroute.router.state import STATE, RouterState
from kvroute.sim.server import SimBackend, SimFleet
from tests.conftest import until
from tests.router.conftest import FakeClock, assert_no_load, router_config

ADMIN_KEY = "admin-key-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHARED = "You are a careful assistant that answers in short sentences. " * 12


def replay_of(b: SimBackend) -> str:
    assert b.publisher is not None and b.publisher.replay_endpoint is not None
    return b.publisher.replay_endpoint


def exact_backends(kv_sims: SimFleet) -> tuple[BackendConfig, ...]:
    urls = kv_sims.urls
    return with_kv_endpoints(
        [BackendConfig(url=u) for u in urls],
        dict(zip(urls, kv_sims.kv_endpoints, strict=True)),
        {b.url: replay_of(b) for b in kv_sims.backends},
    )


async def start_router(
    kv_sims: SimFleet, clock: Any = None, **changes: Any
) -> TestClient[Any, Any]:
    config = router_config(kv_sims.urls, policy="prefix", mode="exact", admin_key=ADMIN_KEY)
    config = dataclasses.replace(config, backends=exact_backends(kv_sims), **changes)
    app = make_app(config, clock=clock) if clock is not None else make_app(config)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    state = client.app[STATE]  # type: ignore[index]
    if state.kv is not None:  # synced from seq 0 by replay
        await until(lambda: all(state.fleet.is_exact(u) for u in kv_sims.urls))
    return client


@pytest.fixture
async def router(kv_sims: SimFleet) -> AsyncIterator[TestClient[Any, Any]]:
    client = await start_router(kv_sims)
    yield client
    assert_no_load(client.app[STATE])  # type: ignore[index]
    await client.close()
    feeds = [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events-")]
    assert not [t for t in feeds if not t.done()], "KV feeds left running after shutdown"


def caught_up(state: RouterState, b: SimBackend) -> bool:
    """The router applied every batch the engine published and the engine is idle."""
    assert b.publisher is not None and state.kv is not None
    status = state.kv.status(b.url)
    last = status.last_seq if status is not None and status.last_seq is not None else -1
    return not b.engine.has_unfinished_requests() and last == b.publisher._seq - 1


async def complete(client: TestClient[Any, Any], prompt: str, **extra: Any) -> Any:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra})
    assert resp.status == 200, await resp.text()
    return resp


async def test_prediction_from_events_equals_engine_cached_tokens(kv_sims: SimFleet) -> None:
    clock = FakeClock()
    client = await start_router(kv_sims, clock=clock)
    state: RouterState = client.app[STATE]  # type: ignore[index]
    try:
        first = await complete(client, SHARED + "What is a KV cache?")
        url = first.headers["x-kvroute-backend"]
        backend = next(b for b in kv_sims.backends if b.url == url)
        await until(lambda: caught_up(state, backend))
        clock.advance(60.0)  # speculative credit expired: only the events speak now
        again = await complete(client, SHARED + "What is a KV cache?")
        assert again.headers["x-kvroute-backend"] == url
        assert again.headers["x-kvroute-decision"] == "prefix"
        cached = (await again.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        bs = next(s for s in state.fleet.backend_states() if s.url == url)
        assert bs.mode == "exact" and bs.kv_num_events > 0 and bs.kv_num_gaps == 0
        assert cached > 0
        assert bs.num_reported == 2 and bs.num_reported_exact == 2  # 0 == 0, then cached
        assert bs.reported_predicted_tokens == bs.reported_hit_tokens == cached
        assert bs.speculative_blocks == 0
        assert {s.mode for s in state.fleet.backend_states()} == {"exact"}
        # a stream reports cached_tokens in its last (usage) chunk: the router reads it too
        await until(lambda: caught_up(state, backend))
        clock.advance(60.0)
        options = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = await complete(client, SHARED + "What is a KV cache?", **options)
        assert streamed.headers["x-kvroute-backend"] == url
        assert f'"cached_tokens":{cached}' in (await streamed.text()).replace(" ", "")
        bs = next(s for s in state.fleet.backend_states() if s.url == url)
        assert bs.num_reported == 3 and bs.num_reported_exact == 3
        assert bs.reported_predicted_tokens == bs.reported_hit_tokens == 2 * cached
    finally:
        assert_no_load(state)
        await client.close()


async def test_burst_with_a_cached_prefix_lands_on_its_holder(kv_sims: SimFleet) -> None:
    """Once one engine's events show the shared prefix, a concurrent burst stays there
    (a burst on a cold prefix may split: waiting behind the first prefill costs as much
    as recomputing elsewhere, and the cost rule knows it)."""
    clock = FakeClock()
    client = await start_router(kv_sims, clock=clock)
    state: RouterState = client.app[STATE]  # type: ignore[index]
    try:
        warm = await complete(client, SHARED + " Question: warm up.")
        holder = warm.headers["x-kvroute-backend"]
        for b in kv_sims.backends:
            await until(lambda b=b: caught_up(state, b))
        clock.advance(60.0)  # no speculative credit left: the view is the engines' events
        prompts = [SHARED + f" Question {i}: name a colour." for i in range(6)]
        responses = await asyncio.gather(*(complete(client, p) for p in prompts))
        assert {r.headers["x-kvroute-backend"] for r in responses} == {holder}
        assert {r.headers["x-kvroute-decision"] for r in responses} == {"prefix"}
        assert state.fleet.key_kind_for("tiny") == "tokens"
    finally:
        await until(lambda: state.num_in_flight == 0)
        assert_no_load(state)
        await client.close()


async def test_metrics_and_status_page_show_the_exact_view(
    kv_sims: SimFleet, router: TestClient[Any, Any]
) -> None:
    state: RouterState = router.app[STATE]  # type: ignore[index]
    await complete(router, SHARED + "once")
    for b in kv_sims.backends:
        await until(lambda b=b: caught_up(state, b))
    text = await (await router.get("/metrics")).text()
    for name in (
        "kvroute_backend_kv_exact",
        "kvroute_backend_kv_lag_seconds",
        "kvroute_backend_kv_events",
        "kvroute_backend_kv_gaps",
        "kvroute_backend_speculative_blocks",
        "kvroute_backend_router_in_flight_requests",
        "kvroute_backend_reported_hit_rate",
        "kvroute_backend_reported_predicted_hit_rate",
    ):
        assert f"{name}{{backend=" in text, name
    for url in kv_sims.urls:
        assert f'kvroute_backend_kv_exact{{backend="{url}"}} 1.0' in text
        assert f'kvroute_backend_kv_gaps{{backend="{url}"}} 0.0' in text
    page = await (await router.get("/")).text()
    assert "mode <b>exact</b>" in page
    for header in ("KV events", "event lag s", "speculative", "reported hit"):
        assert header in page
    kv = await (await router.get("/admin/kv", headers=ADMIN)).json()
    assert kv["mode"] == "exact"
    assert {r["url"]: r["mode"] for r in kv["backends"]} == dict.fromkeys(kv_sims.urls, "exact")
    held = sum(r["confirmed_blocks"] for r in kv["backends"])
    assert held == sum(len(b.engine.block_manager._hash_to_block) for b in kv_sims.backends)


async def test_admin_remove_drops_the_subscription_and_add_restores_it(
    kv_sims: SimFleet, router: TestClient[Any, Any]
) -> None:
    state: RouterState = router.app[STATE]  # type: ignore[index]
    assert state.kv is not None
    gone = kv_sims.backends[1]
    resp = await router.delete("/admin/backends", params={"url": gone.url}, headers=ADMIN)
    assert resp.status == 200
    assert state.kv.status(gone.url) is None and gone.url not in state.kv.urls()
    assert gone.url not in state.fleet.urls()
    body = {"url": gone.url, "kv_events": kv_sims.kv_endpoints[1], "kv_replay": replay_of(gone)}
    resp = await router.post("/admin/backends", json=body, headers=ADMIN)
    assert resp.status == 201
    assert (await resp.json())["kv_events"] == kv_sims.kv_endpoints[1]
    await until(lambda: state.fleet.is_exact(gone.url))  # synced again by replay from 0
    status = state.kv.status(gone.url)
    assert status is not None and status.running


async def test_approximate_mode_ignores_kv_events(kv_sims: SimFleet) -> None:
    client = await start_router(kv_sims, mode="approximate")
    state: RouterState = client.app[STATE]  # type: ignore[index]
    try:
        assert state.kv is None
        await complete(client, SHARED + "plain")
        assert {s.mode for s in state.fleet.backend_states()} == {"approximate"}
        assert state.fleet.key_kind_for("tiny") == "text"
    finally:
        assert_no_load(state)
        await client.close()


async def test_a_batch_that_fails_to_apply_turns_its_backend_approximate(
    kv_sims: SimFleet, router: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    state: RouterState = router.app[STATE]  # type: ignore[index]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug while applying a batch")

    monkeypatch.setattr(state.fleet, "apply_kv_batch", broken)
    first = await complete(router, SHARED + "events now break the feed")
    url = first.headers["x-kvroute-backend"]
    assert state.kv is not None
    await until(lambda: state.kv.status(url).num_malformed_batches > 0)  # type: ignore[union-attr]
    monkeypatch.undo()
    assert state.kv.status(url).running  # the batch is skipped, the feed goes on
    assert not state.fleet.is_exact(url)  # a view that missed a batch is not trusted
    metrics = await (await router.get("/metrics")).text()
    assert f'kvroute_backend_kv_malformed_batches{{backend="{url}"}}' in metrics
    for name in ("bad_messages", "disconnects"):  # counted by the feed: exported too
        assert f'kvroute_backend_kv_{name}{{backend="{url}"}} 0.0' in metrics
    again = await complete(router, SHARED + "still routed")
    assert again.status == 200


async def test_salted_blocks_are_keyed_with_their_salt(kv_sims: SimFleet) -> None:
    """The engine's events carry a request's cache_salt (extra keys of its first block):
    the exact view keys those blocks as salted requests are keyed, so only a request with
    the same salt is predicted (and gets) a hit."""
    clock = FakeClock()
    client = await start_router(kv_sims, clock=clock)
    state: RouterState = client.app[STATE]  # type: ignore[index]

    async def ask(question: str, **salt: str) -> tuple[str, str, int]:
        resp = await complete(client, SHARED + question, **salt)
        cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        url = resp.headers["x-kvroute-backend"]
        await until(lambda: caught_up(state, next(b for b in kv_sims.backends if b.url == url)))
        clock.advance(60.0)  # speculative credit expired: only the events speak
        return url, resp.headers["x-kvroute-decision"], cached

    try:
        url, decision, cached = await ask("First?", cache_salt="tenant-a")
        assert (decision, cached) == ("cold", 0)
        assert (await ask("Second?"))[1:] == ("cold", 0)  # no salt: the engine misses too
        again, decision, cached = await ask("Third?", cache_salt="tenant-a")
        assert (again, decision) == (url, "prefix") and cached > 0
        states = state.fleet.backend_states()
        assert sum(s.num_reported for s in states) == 3
        assert sum(s.num_reported_exact for s in states) == 3  # predicted == engine's
    finally:
        assert_no_load(state)
        await client.close()
