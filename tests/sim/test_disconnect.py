"""A client that goes away mid-request frees its engine slot and KV blocks."""

from __future__ import annotations

import aiohttp

from tests.conftest import until
from tests.sim.helpers import long_prompt, scrape


async def _wait_idle(backend) -> None:
    await until(lambda: not backend.engine.has_unfinished_requests())


async def test_disconnect_mid_stream_aborts_the_request(fleet, session):
    backend = fleet.backends[0]
    body = {"prompt": long_prompt("leave", 300), "max_tokens": 4000, "stream": True}
    resp = await session.post(fleet.urls[0] + "/v1/completions", json=body)
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    assert backend.engine.stats.num_running == 1
    assert backend.engine.stats.kv_cache_usage > 0
    resp.close()  # drop the connection
    await _wait_idle(backend)
    stats = backend.engine.stats
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
    metrics = await scrape(session, fleet.urls[0])
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:request_success_total{finished_reason=abort}"] == 1


async def test_disconnect_while_waiting_for_a_full_answer_aborts(fleet, session):
    backend = fleet.backends[1]
    body = {"prompt": long_prompt("gone", 300), "max_tokens": 4000}
    with_timeout = aiohttp.ClientTimeout(total=0.2)
    try:
        async with session.post(fleet.urls[1] + "/v1/completions", json=body,
                                timeout=with_timeout) as resp:  # fmt: skip
            await resp.read()
    except TimeoutError:
        pass
    await _wait_idle(backend)
    assert backend.engine.stats.num_running == 0
    assert backend.engine.stats.kv_cache_usage == 0
    metrics = await scrape(session, fleet.urls[1])
    assert metrics["vllm:request_success_total{finished_reason=abort}"] == 1
