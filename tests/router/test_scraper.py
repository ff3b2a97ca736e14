"""The metrics scraper's parser on a vLLM-shaped /metrics page, and the Fleet update."""

from __future__ import annotations

from kvroute.router.scraper import parse_engine_metrics
from tests.router.conftest import Harness

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m1"} 3.0
vllm:num_requests_running{engine="1",model_name="m1"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m1"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m1"} 0.25
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m1"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m1"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m1"} 400.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",cache_dtype="auto"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m1"} 0.0
"""


def test_parse_vllm_page() -> None:
    s = parse_engine_metrics(PAGE)
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (5, 7, 0.25)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (1000.0, 400.0)
    assert (s.block_size, s.num_gpu_blocks) == (16, 2048)


def test_parse_page_without_vllm_metrics() -> None:
    s = parse_engine_metrics("# TYPE other gauge\nother 1\n")
    assert s.num_running is None and s.block_size is None and s.kv_cache_usage is None


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


def test_odd_values_on_the_page_are_ignored_not_raised() -> None:
    """+Inf, NaN and negative gauges (a broken or hostile engine) are no state: round(inf)
    raised OverflowError and lost the whole sample."""
    page = (
        PAGE.replace("} 3.0", "} +Inf")
        .replace("} 7.0", "} NaN")
        .replace("} 0.25", "} -1")
        .replace('num_gpu_blocks="2048"', 'num_gpu_blocks="inf"')
    )
    s = parse_engine_metrics(page)
    assert s.num_running == 2  # only the finite series of the family
    assert s.num_waiting is None
    assert s.kv_cache_usage is None
    assert s.num_gpu_blocks is None
    assert s.block_size == 16
    assert s.prefix_cache_hits == 400.0


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
