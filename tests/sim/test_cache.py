"""Prefix caching seen from the client and from /metrics, per backend."""

from __future__ import annotations

from kvroute.common.tokenizer import default_tokenizer
from tests.sim.helpers import long_prompt, post, scrape

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


async def test_repeat_hits_the_cache_and_counters_move_by_exactly_that(fleet, session):
    a, b = fleet.urls
    prompt = long_prompt("repeat", 400)
    num_prompt = len(default_tokenizer().encode(prompt))
    body = {"prompt": prompt, "max_tokens": 3}

    _, first = await post(session, a + "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = await scrape(session, a)
    _, second = await post(session, a + "/v1/completions", body)
    after = await scrape(session, a)

    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert num_prompt - 16 <= cached < num_prompt  # all full blocks, never the last token
    assert cached % 16 == 0
    assert after[HITS] - before[HITS] == cached
    assert after[QUERIES] - before[QUERIES] == num_prompt

    _, other = await post(session, b + "/v1/completions", body)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await scrape(session, b))[HITS] == 0


async def test_metrics_parse_and_move_with_requests(fleet, session):
    url = fleet.urls[0]
    m0 = await scrape(session, url)
    assert m0["vllm:cache_config_info{block_size=16,enable_prefix_caching=True,num_cpu_blocks=0,"
              "num_gpu_blocks=512,prefix_caching_hash_algo=sim}"] == 1.0  # fmt: skip
    assert m0["vllm:num_requests_running"] == 0 and m0["vllm:num_requests_waiting"] == 0
    prompt = long_prompt("metrics", 100)
    num_prompt = len(default_tokenizer().encode(prompt))
    for _ in range(2):
        status, _ = await post(
            session, url + "/v1/completions", {"prompt": prompt, "max_tokens": 4}
        )
        assert status == 200
    m = await scrape(session, url)
    assert m["vllm:request_success_total{finished_reason=length}"] == 2
    assert m["vllm:prompt_tokens_total"] == 2 * num_prompt
    assert m["vllm:generation_tokens_total"] == 8
    assert m["vllm:time_to_first_token_seconds_count"] == 2
    assert m["vllm:e2e_request_latency_seconds_count"] == 2
    assert m[QUERIES] == 2 * num_prompt and m[HITS] > 0
    # blocks of finished requests stay cached but are no longer in use
    assert m["vllm:kv_cache_usage_perc"] == 0.0


async def test_reset_prefix_cache_turns_the_next_repeat_into_a_miss(fleet, session):
    url = fleet.urls[0]
    body = {"prompt": long_prompt("reset", 100), "max_tokens": 2}
    await post(session, url + "/v1/completions", body)
    async with session.post(url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    _, again = await post(session, url + "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_cache_salt_isolates_prefixes(fleet, session):
    url = fleet.urls[0] + "/v1/completions"
    prompt = long_prompt("salted", 100)
    await post(session, url, {"prompt": prompt, "max_tokens": 2})
    _, salted = await post(session, url, {"prompt": prompt, "max_tokens": 2, "cache_salt": "u1"})
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
