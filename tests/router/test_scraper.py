"""The metrics scraper feeds what a vLLM-shaped /metrics page says into the Fleet."""

from __future__ import annotations

from tests.common.test_vllm_metrics import PAGE
from tests.router.conftest import Harness


async def test_scrape_feeds_the_fleet(harness: Harness) -> None:
    from kvroute.router.scraper import scrape

    b = await harness.backend("a")
    b.state.metrics_text = PAGE.replace("num_gpu_blocks", "num_gpu_blocks")
    client = await harness.router([b.url])
    state = harness.state(client)
    rt = state.backends.get(b.url)
    assert rt is not None
    await scrape(state, rt)
    (bs,) = state.fleet.backend_states()
    assert bs.engine_num_waiting == 7
    assert bs.kv_cache_usage == 0.25
    assert bs.block_size == 16
    assert bs.capacity_blocks == 2048
    assert state.fleet.block_size_for("m1") == 16
    b.state.metrics_text = PAGE.replace(" 1000.0", " 1100.0").replace(" 400.0", " 480.0")
    await scrape(state, rt)
    row = (await (await client.get("/metrics")).text()).splitlines()
    assert any(
        line.startswith("kvroute_backend_measured_hit_rate") and line.endswith(" 0.8")
        for line in row
    )
    # the engine's queue is merged into load; clear it so the leak check sees ours only
    b.state.metrics_text = (
        PAGE.replace(" 3.0", " 0.0").replace(" 2.0", " 0.0").replace(" 7.0", " 0.0")
    )
    await scrape(state, rt)


async def test_a_scrape_that_ends_after_its_backend_left_routing_is_dropped(
    harness: Harness,
) -> None:
    """A backend that turned unroutable while its page was in flight keeps no gauges:
    turning unroutable cleared them, and the late sample must not write them back."""
    import asyncio

    from kvroute.router.scraper import scrape

    b = await harness.backend("a")
    b.state.metrics_text = PAGE
    client = await harness.router([b.url])
    state = harness.state(client)
    rt = state.backends.get(b.url)
    assert rt is not None and rt.routable
    task = asyncio.create_task(scrape(state, rt))
    state.backends.record_probe(b.url, False, "down")
    state.backends.record_probe(b.url, False, "down")
    assert not rt.routable and rt.engine is None
    assert await task is None
    assert rt.engine is None
    (bs,) = state.fleet.backend_states()
    assert bs.engine_num_waiting is None


async def test_metrics_export_loop_tasks_and_requests_in_flight(harness: Harness) -> None:
    """What a soak watches for leaks: tasks on the loop, requests being handled."""
    b = await harness.backend("a")
    client = await harness.router([b.url])
    assert (await client.post("/v1/completions", json={"model": "m1", "prompt": "x"})).status == 200
    lines = (await (await client.get("/metrics")).text()).splitlines()
    tasks = [line for line in lines if line.startswith("kvroute_event_loop_tasks ")]
    assert len(tasks) == 1 and float(tasks[0].split()[1]) >= 1
    assert "kvroute_in_flight_requests 0.0" in lines


async def test_a_page_without_any_load_gauge_kvroute_reads_says_so(harness: Harness) -> None:
    """A /metrics that answers 200 with other names (an engine kvroute does not know)
    leaves the engine's load unknown: the scrape reports it, as a failed one, once."""
    from kvroute.router.scraper import scrape

    b = await harness.backend("a")
    b.state.metrics_text = "# TYPE other_engine_running gauge\nother_engine_running 3\n"
    client = await harness.router([b.url])
    state = harness.state(client)
    rt = state.backends.get(b.url)
    assert rt is not None
    error = await scrape(state, rt)
    assert error is not None and "no load gauge" in error and "sglang:" in error
