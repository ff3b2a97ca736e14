"""The one parser of vLLM's /metrics page (router scraper and benchmarks)."""

from __future__ import annotations

import pytest

from kvroute.common.vllm_metrics import parse_vllm_metrics

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
    s = parse_vllm_metrics(PAGE)
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (5, 7, 0.25)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (1000.0, 400.0)
    assert (s.block_size, s.num_gpu_blocks) == (16, 2048)
    assert s.prompt_tokens is None and s.num_preemptions is None


def test_parse_page_without_vllm_metrics() -> None:
    s = parse_vllm_metrics("# TYPE other gauge\nother 1\n")
    assert s.num_running is None and s.block_size is None and s.kv_cache_usage is None
    assert s.prefix_cache_queries is None and s.prefix_cache_hits is None


OLD_NAMES = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m1"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m1"} 300.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m1"} 120.0
"""


def test_names_of_older_vllm_releases_are_read() -> None:
    s = parse_vllm_metrics(OLD_NAMES)
    assert (s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits) == (0.5, 300.0, 120.0)


def test_a_page_with_old_and_new_names_is_not_counted_twice() -> None:
    """vLLM 0.9.2 to 0.10 exported the deprecated names beside the new ones (same values):
    summing both doubled the counters (the benchmarks did)."""
    s = parse_vllm_metrics(PAGE + OLD_NAMES)
    assert (s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits) == (0.25, 1000.0, 400.0)


def test_counters_sum_over_engines_and_cumulative_extras_are_read() -> None:
    page = PAGE + (
        'vllm:prefix_cache_hits_total{engine="1",model_name="m1"} 100.0\n'
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m1"} 1234.0\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m1"} 2.0\n'
    )
    s = parse_vllm_metrics(page)
    assert (s.prefix_cache_hits, s.prompt_tokens, s.num_preemptions) == (500.0, 1234.0, 2.0)


@pytest.mark.parametrize("value", ['"None"', '""', '"0"', '"sixteen"', '"16.0"'])
def test_cache_config_labels_that_are_no_size(value: str) -> None:
    page = f'vllm:cache_config_info{{block_size={value},num_gpu_blocks="64"}} 1.0\n'
    s = parse_vllm_metrics(page)
    assert s.block_size == (16 if value == '"16.0"' else None)
    assert s.num_gpu_blocks == 64


def test_odd_values_on_the_page_are_ignored_not_raised() -> None:
    """+Inf, NaN and negative gauges (a broken or hostile engine) are no state: round(inf)
    raised OverflowError and lost the whole sample."""
    page = (
        PAGE.replace("} 3.0", "} +Inf")
        .replace("} 7.0", "} NaN")
        .replace("} 0.25", "} -1")
        .replace('num_gpu_blocks="2048"', 'num_gpu_blocks="inf"')
    )
    s = parse_vllm_metrics(page)
    assert s.num_running == 2  # only the finite series of the family
    assert s.num_waiting is None
    assert s.kv_cache_usage is None
    assert s.num_gpu_blocks is None
    assert s.block_size == 16
    assert s.prefix_cache_hits == 400.0


@pytest.mark.parametrize(
    ("page", "running", "waiting", "usage"),
    [
        (  # SGLang with --enable-metrics (docs: references/production_metrics)
            "# TYPE sglang:num_running_reqs gauge\n"
            'sglang:num_running_reqs{model_name="m1"} 5.0\n'
            "# TYPE sglang:num_queue_reqs gauge\n"
            'sglang:num_queue_reqs{model_name="m1"} 2.0\n'
            "# TYPE sglang:token_usage gauge\n"
            'sglang:token_usage{model_name="m1"} 0.5\n',
            5,
            2,
            0.5,
        ),
        (  # llama.cpp's llama-server with --metrics (tools/server/server-context.cpp)
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 3\n",
            1,
            3,
            None,
        ),
        (  # TGI (reference/metrics)
            "# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n"
            "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 8\n",
            8,
            4,
            None,
        ),
    ],
    ids=["sglang", "llama.cpp", "tgi"],
)
def test_other_engines_load_gauges_are_read(
    page: str, running: int, waiting: int, usage: float | None
) -> None:
    m = parse_vllm_metrics(page)
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (running, waiting, usage)


def test_sglangs_token_counters_are_its_prefix_cache_queries_and_hits() -> None:
    """sglang:prompt_tokens_total and sglang:cached_tokens_total (one series per
    cache_source: device, host, storage), observability/metrics_collector.py."""
    page = (
        "# TYPE sglang:prompt_tokens counter\n"
        'sglang:prompt_tokens_total{model_name="m1"} 1000.0\n'
        'sglang:prompt_tokens_created{model_name="m1"} 1.7e9\n'
        "# TYPE sglang:cached_tokens counter\n"
        'sglang:cached_tokens_total{model_name="m1",cache_source="device"} 300.0\n'
        'sglang:cached_tokens_total{model_name="m1",cache_source="host"} 100.0\n'
    )
    m = parse_vllm_metrics(page)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000.0, 400.0)
