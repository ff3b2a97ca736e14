"""A live exact-mode router applies every KV event: after a run that stores and evicts
blocks, its held blocks per backend (``GET /admin/kv``: count and a digest of the keys)
equal those of an independent follower of the same event streams (bench/kv_view.py, the
check that exact_vs_approx reports)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

from aiohttp.test_utils import TestClient, TestServer

from kvroute.bench.kv_view import EventFollower, settled_views, view_check
from kvroute.bench.procs import SimEngine
from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, with_kv_endpoints
from kvroute.router.state import STATE, RouterState
from kvroute.sim.server import SimFleet
from tests.conftest import until
from tests.router.conftest import assert_no_load, router_config

ADMIN_KEY = "view-check-admin"
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta")


def engines_of(kv_sims: SimFleet) -> list[SimEngine]:
    out = []
    for b, events in zip(kv_sims.backends, kv_sims.kv_endpoints, strict=True):
        assert b.publisher is not None
        out.append(SimEngine(b.url, events, b.publisher.replay_endpoint))
    return out


def prompts(n: int) -> list[str]:
    """Four shared heads of 400 words (a word is a token of the built-in tokenizer), each
    prompt with a 600-word tail of its own: 36 tails alone are 21,600 tokens, more than
    two tiny engines hold (2 x 8,192), so the run evicts blocks."""
    rng = random.Random(7)
    heads = [" ".join(rng.choices(WORDS, k=400)) for _ in range(4)]
    return [f"{heads[i % 4]} tail{i} " + " ".join(rng.choices(WORDS, k=600)) for i in range(n)]


async def test_a_live_router_holds_what_the_events_say(kv_sims: SimFleet) -> None:
    engines = engines_of(kv_sims)
    backends = with_kv_endpoints(
        [BackendConfig(url=e.url) for e in engines],
        {e.url: e.kv_events or "" for e in engines},
        {e.url: e.kv_replay or "" for e in engines},
    )
    config = router_config(kv_sims.urls, policy="prefix", mode="exact", admin_key=ADMIN_KEY)
    client = TestClient(TestServer(make_app(dataclasses.replace(config, backends=backends))))
    await client.start_server()
    state: RouterState = client.app[STATE]  # type: ignore[index]
    follower = EventFollower(engines)
    follower.start()
    try:
        await until(lambda: all(state.fleet.is_exact(u) for u in kv_sims.urls))
        gate = asyncio.Semaphore(4)

        async def send(prompt: str) -> None:
            async with gate:
                body = {"prompt": prompt, "max_tokens": 2}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status == 200, await resp.text()

        await asyncio.gather(*(send(p) for p in prompts(36)))
        for b in kv_sims.backends:  # every event out of the engines
            await until(lambda b=b: not b.engine.has_unfinished_requests())
        router_url = str(client.make_url("")).rstrip("/")
        kv, snap = await settled_views(router_url, ADMIN_KEY, follower, exact=True)
        check = view_check(kv, snap, exact=True)
        assert check["backends_equal"] == "2/2", check["per_backend"]
        assert all(v["exact"] and v["gaps"] == 0 for v in snap.values())
        assert check["router_blocks"] == check["engine_blocks"] > 0
        # more was stored than fits: the views agree after removals too
        assert check["engine_blocks"] <= sum(
            b.engine.stats.num_gpu_blocks for b in kv_sims.backends
        )
    finally:
        await asyncio.to_thread(follower.stop)
        assert_no_load(state)
        await client.close()
