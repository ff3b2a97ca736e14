"""A backend that was unreachable and answers again may be a restarted engine with an
empty prefix cache: its approximate cache model starts empty (soak finding: a restarted
backend kept being sent prompts for hits it no longer had)."""

from __future__ import annotations

from tests.router.conftest import Harness


async def test_a_backend_back_from_failed_probes_starts_with_an_empty_cache_model(
    harness: Harness,
) -> None:
    a, b = await harness.backend("a"), await harness.backend("b")
    client = await harness.router([a.url, b.url], policy="prefix")
    state = harness.state(client)
    body = {"model": "m1", "prompt": "a long shared system prompt " * 40, "max_tokens": 4}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    holder = resp.headers["x-kvroute-backend"]
    assert state.fleet.index.num_blocks(holder) > 0
    other = b.url if holder == a.url else a.url
    blocks_elsewhere = state.fleet.index.num_blocks(other)

    state.backends.record_probe(holder, True)  # a good probe changes nothing
    assert state.fleet.index.num_blocks(holder) > 0
    for _ in range(state.config.health.unhealthy_after):
        state.backends.record_probe(holder, False, "connection refused")
    assert state.fleet.index.num_blocks(holder) > 0  # down: kept, it may come back as it was
    state.backends.record_probe(holder, True)
    assert state.fleet.index.num_blocks(holder) == 0
    assert state.fleet.index.num_blocks(other) == blocks_elsewhere
    state.fleet.check_invariants()
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert resp.headers["x-kvroute-decision"] != "prefix"  # no hit predicted on a cold engine
