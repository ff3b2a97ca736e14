"""The infinite-cache ceiling: hand-built prompts with known answers, the engine's own keys,
and on a short simulated comparison a ceiling no router's engine hit rate exceeds."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.bench.ceiling import (
    DEFAULT_BLOCK_SIZE,
    InfiniteCache,
    SentSpecs,
    block_size_of,
    ceiling_hit_rate,
    run_ceiling,
    spec_token_ids,
)
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.spec import RequestSpec
from kvroute.bench.workloads import make_workload
from kvroute.common.tokenizer import default_tokenizer
from kvroute.engine.engine import Engine
from kvroute.sim import protocol
from kvroute.sim.profiles import get_profile

BS = 16


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def words(word: str, n: int) -> str:
    return " ".join([word] * n)  # each synthetic word is one token


def completion(request_id: str, prompt: str) -> RequestSpec:
    return RequestSpec(
        request_id=request_id,
        endpoint="completions",
        messages=None,
        prompt=prompt,
        max_tokens=4,
        num_prompt_tokens=default_tokenizer().count(prompt),
        prefix_group="g",
    )


def chat(request_id: str, system: str, user: str) -> RequestSpec:
    return RequestSpec.chat(request_id, (("system", system), ("user", user)), 4, "g")


def record(request_id: str, start_s: float, *, warmup: bool = False, ok: bool = True):
    return RequestRecord(
        request_id=request_id,
        prefix_group="g",
        session_id=None,
        turn=0,
        start_s=start_s,
        ok=ok,
        ttft_s=0.01 if ok else None,
        itl_s=(),
        e2e_s=0.02,
        prompt_tokens=1,
        output_tokens=1,
        cached_tokens=None,
        backend=None,
        warmup=warmup,
    )


# --- the arithmetic -------------------------------------------------------------------


def test_a_prompt_sent_twice_hits_its_full_blocks_the_second_time():
    a = ids(100)  # 6 full blocks of 16 and a 4-token tail
    assert ceiling_hit_rate([(a, True), (a, True)], BS) == pytest.approx(6 * BS / (2 * 100))


def test_a_hit_is_whole_blocks_of_the_shared_prefix():
    a, b = ids(100), ids(40) + ids(60, start=9000)  # 40 tokens shared: 2 whole blocks
    assert ceiling_hit_rate([(a, True), (b, True)], BS) == pytest.approx(2 * BS / 200)
    assert ceiling_hit_rate([(a, True), (b, True)], 8) == pytest.approx(5 * 8 / 200)


def test_the_last_token_is_always_computed():
    a = ids(64)  # exactly 4 blocks: the repeat may hit 63 tokens, so 3 blocks
    assert ceiling_hit_rate([(a, True), (a, True)], BS) == pytest.approx(3 * BS / 128)
    b = ids(65)  # one more token and the fourth block counts
    assert ceiling_hit_rate([(b, True), (b, True)], BS) == pytest.approx(4 * BS / 130)
    one = ids(1)
    assert ceiling_hit_rate([(one, True), (one, True)], 1) == 0.0


def test_a_longer_prompt_hits_the_blocks_a_shorter_one_computed_and_not_beyond():
    short, long = ids(50), ids(200)
    cache = InfiniteCache(BS)
    assert cache.add(short) == 0
    assert cache.add(long) == 3 * BS  # the short prompt left 3 full blocks
    assert cache.add(short) == 3 * BS  # capped by its own length - 1
    assert cache.hit_rate == pytest.approx(6 * BS / 300)


def test_warm_up_fills_the_cache_but_is_not_counted():
    a = ids(100)
    assert ceiling_hit_rate([(a, False), (a, True)], BS) == pytest.approx(96 / 100)
    assert ceiling_hit_rate([(a, False)], BS) is None  # nothing measured: no rate


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        InfiniteCache(0)


# --- prompts as the engine renders and tokenizes them ---------------------------------

SYSTEM = words("code", 64)


def test_chat_prompts_share_their_rendered_system_prompt():
    a, b = chat("a", SYSTEM, words("the", 8)), chat("b", SYSTEM, words("and", 8))
    # "<|system|>\n" 7 tokens + 64 + "\n" + "<|user|>\n" 6 = 78 shared: 4 whole blocks
    assert len(spec_token_ids(a)) == a.num_prompt_tokens == 95
    specs = {s.request_id: s for s in (a, b)}
    rate = run_ceiling([record("a", 0.0), record("b", 1.0)], specs, BS)
    assert rate == pytest.approx(4 * BS / (2 * 95))


def test_completions_prompts_are_the_raw_text_and_share_nothing_with_chat():
    c1 = completion("c1", SYSTEM + " " + words("the", 8))
    c2 = completion("c2", SYSTEM + " " + words("and", 8))
    b = chat("b", SYSTEM, words("and", 8))
    specs = {s.request_id: s for s in (c1, c2, b)}
    assert run_ceiling([record("c1", 0.0), record("c2", 1.0)], specs, BS) == pytest.approx(
        4 * BS / (2 * 72)
    )
    # the chat template comes first, so the same system text is no shared prefix
    assert run_ceiling([record("c1", 0.0), record("b", 1.0)], specs, BS) == 0.0


@pytest.mark.parametrize("name", ["gsp", "multiturn", "agentic"])
def test_keys_are_the_engines_own(name):
    """Prompts sent one at a time to one engine whose cache holds them all: its counters
    give exactly the ceiling, so the ceiling keys prompts as the engine does."""
    overrides = {
        "gsp": {"num_groups": "3", "system_prompt_tokens": "100", "question_tokens": "20"},
        "multiturn": {"system_prompt_tokens": "60", "user_tokens": "5,20", "answer_tokens": "9"},
        "agentic": {},
    }[name]
    specs = list(_first(make_workload(name, seed=2, overrides=overrides), 24))
    big = dataclasses.replace(
        get_profile("tiny"), kv_capacity_tokens=1 << 22, max_model_len=1 << 20
    )
    engine = Engine(big)
    tokenizer = default_tokenizer()
    for spec in specs:
        prompt = protocol.prompt_ids(spec.body(None), spec.endpoint == "chat", tokenizer)
        assert prompt == spec_token_ids(spec)
        engine.add_request(spec.request_id, prompt, 1)
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.stats
    records = [record(s.request_id, float(i)) for i, s in enumerate(specs)]
    rate = run_ceiling(records, {s.request_id: s for s in specs}, big.block_size)
    assert stats.prefix_cache_hits > 0
    assert rate == pytest.approx(stats.prefix_cache_hits / stats.prefix_cache_queries)


def _first(workload, n: int):
    requests = workload.requests()
    return [next(requests) for _ in range(n)]


# --- which requests, in which order ---------------------------------------------------


def test_records_are_replayed_warm_up_first_then_by_send_time():
    a = completion("a", words("data", 100))
    b = completion("b", words("data", 100))
    specs = {"a": a, "b": b, "x": completion("x", words("user", 50))}
    # warm-up times count from the warm-up's start, so a later number can come first
    recs = [record("b", 0.5), record("a", 9.0, warmup=True)]
    assert run_ceiling(recs, specs, BS) == pytest.approx(6 * BS / 100)
    # both measured, b sent first: a hits, b does not
    recs = [record("a", 2.0), record("b", 1.0), record("x", 3.0)]
    assert run_ceiling(recs, specs, BS) == pytest.approx(6 * BS / 250)
    # a record without a spec is left out; no records at all: no rate
    assert run_ceiling([record("zz", 0.0), record("b", 1.0)], specs, BS) == 0.0
    assert run_ceiling([], specs, BS) is None


def test_sent_specs_passes_sessions_through_and_keeps_what_was_drawn():
    inner = make_workload("multiturn", seed=4)
    wrapped = SentSpecs(inner)
    drawn = next(wrapped.sessions())
    assert drawn == next(make_workload("multiturn", seed=4).sessions())
    assert set(wrapped.specs) == {s.request_id for s in drawn}
    assert wrapped.describe() == inner.describe() and wrapped.name == inner.name


def test_block_size_is_read_from_cache_config_info():
    page = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="512",engine="0"} 1.0\n'
    )
    assert block_size_of(page) == 32
    assert block_size_of("vllm:prefix_cache_hits_total 3.0\n") is None
    assert block_size_of("not { a metrics page") is None
    assert DEFAULT_BLOCK_SIZE == 16


# --- end to end -----------------------------------------------------------------------


async def test_on_a_short_comparison_no_router_beats_the_ceiling(tmp_path):
    """Two routers on a tiny fleet: each run has its own ceiling, at least the engines'
    measured hit rate, printed beside it and kept in compare.json."""
    from kvroute.bench.compare import CompareConfig, run_compare_async
    from kvroute.bench.compare_report import format_table, write_compare

    config = CompareConfig(
        "gsp",
        ("round_robin", "kvroute"),
        num_backends=2,
        profile="tiny",
        speedup=2.0,
        workload_overrides={
            "num_groups": "4",
            "system_prompt_tokens": "200",
            "question_tokens": "30",
            "output_tokens": "8",
        },
        load_overrides={"num_users": 4, "num_requests": 40, "num_warmup": 4},
        log_dir=tmp_path / "logs",
        progress=False,
    )
    outcomes = await run_compare_async(config)
    for name, outcome in outcomes.items():
        assert outcome.bench is not None, (name, outcome.error)
        result = outcome.bench.result
        ceiling, engine = result["cache_ceiling_hit_rate"], result["engine_prefix_hit_rate"]
        assert ceiling is not None and engine is not None
        assert ceiling >= engine - 1e-9, name
        assert result["cache_ceiling_block_size"] == 16
    table = format_table(outcomes)
    assert "ceiling" in table.splitlines()[0]
    kv_line = next(line for line in table.splitlines() if line.startswith("kvroute"))
    ceiling_pct = 100 * outcomes["kvroute"].bench.result["cache_ceiling_hit_rate"]
    assert f"{ceiling_pct:.1f} %" in kv_line
    write_compare(outcomes, tmp_path / "out", plots=False)
    data = (tmp_path / "out" / "compare.json").read_text()
    assert '"cache_ceiling_hit_rate"' in data
