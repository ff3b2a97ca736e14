"""Engine-level behaviour: profile arithmetic, prefix-cache counters, KV events, aborts,
jitter and input validation."""

from __future__ import annotations

import random

import pytest

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.engine import PROFILES, Engine, EngineProfile
from kvroute.engine.engine import HashedTokens, token_span

from .helpers import make_profile, run_to_completion, tokens


def time_to_first_token_s(engine: Engine, request_id: str, prompt: list[int]) -> float:
    """Engine time from add_request to the step that yields the first token (no a_api)."""
    engine.add_request(request_id, prompt, 1)
    elapsed = 0.0
    for _ in range(100):
        result = engine.step()
        elapsed += result.duration_s
        if any(o.request_id == request_id and o.is_first for o in result.outputs):
            return elapsed
    raise AssertionError("no first token")


def test_codellama_4k_miss_costs_about_0_7_s_and_a_hit_about_one_step() -> None:
    profile = PROFILES["codellama-13b-a100"]
    engine = Engine(profile)
    prompt = tokens(100, 4000)
    miss_s = time_to_first_token_s(engine, "miss", prompt)
    assert 0.5 <= miss_s <= 0.9
    hit_s = time_to_first_token_s(engine, "hit", prompt)
    assert hit_s + profile.a_api_ms / 1000 < 0.08
    assert hit_s < miss_s / 10


@pytest.mark.parametrize(
    ("name", "table_ttft_s"),
    [
        ("llama-3.1-8b-a100", 0.4),
        ("codellama-13b-a100", 0.7),
        ("codellama-13b-a100-40g", 0.7),
        ("llama-3.1-70b-a100-tp4", 1.1),
        ("llama-3.1-8b-h100", 0.15),
        ("llama-3.1-70b-h100-tp4", 0.33),
        ("tiny", 0.04),
    ],
)
def test_every_profile_matches_its_4k_miss_ttft(name: str, table_ttft_s: float) -> None:
    profile = PROFILES[name]
    ttft_s = time_to_first_token_s(Engine(profile), "r", tokens(0, 4000)) + profile.a_api_ms / 1e3
    assert ttft_s == pytest.approx(table_ttft_s, rel=0.15)


def test_instant_profile_costs_nothing() -> None:
    engine = Engine(PROFILES["instant"])
    engine.add_request("r", tokens(0, 4000), 3)
    clock, outputs = run_to_completion(engine)
    assert clock == 0.0 and len(outputs["r"]) == 3


def test_prefix_cache_counters_are_in_tokens() -> None:
    engine = Engine(PROFILES["codellama-13b-a100"])
    prompt = tokens(7, 4000)
    engine.add_request("a", prompt, 1)
    run_to_completion(engine)
    engine.add_request("b", prompt, 1)
    engine.add_request("c", [*prompt[:1000], *tokens(90_000, 500)], 1)
    _, outputs = run_to_completion(engine)
    stats = engine.stats
    assert stats.prefix_cache_queries == 4000 + 4000 + 1500
    assert stats.prefix_cache_hits == 3984 + 992  # block aligned, last block recomputed
    assert outputs["b"][0].num_cached_tokens == 3984
    assert outputs["c"][0].num_cached_tokens == 992
    assert (stats.block_size, stats.num_gpu_blocks) == (16, 58_000 // 16)


def test_kv_events_name_blocks_with_the_routers_keys() -> None:
    engine = Engine(make_profile(), enable_kv_events=True, next_token=lambda rid, i: 9)
    prompt = tokens(0, 40)
    engine.add_request("a", prompt, 9)  # 49 tokens in the end: 3 full blocks
    engine.step()
    keys = token_block_hashes(prompt, 16)
    assert engine.drain_kv_events() == [BlockStored(keys, None, prompt[:32], 16)]
    run_to_completion(engine)
    third = token_block_hashes([*prompt, *[9] * 8], 16)[2]
    assert engine.drain_kv_events() == [BlockStored([third], keys[1], [*prompt[32:], *[9] * 8], 16)]
    assert engine.drain_kv_events() == []


def test_eviction_and_reset_emit_events() -> None:
    profile = make_profile(kv_capacity_tokens=64, max_model_len=64)  # 4 blocks
    engine = Engine(profile, enable_kv_events=True)
    engine.add_request("a", tokens(0, 33), 1)
    run_to_completion(engine)
    stored = engine.drain_kv_events()[0]
    assert isinstance(stored, BlockStored)
    engine.add_request("b", tokens(500, 60), 4)  # needs all 4 blocks
    engine.step()
    assert not engine.reset_prefix_cache()  # b holds blocks
    removed = [e for e in engine.drain_kv_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)
    run_to_completion(engine)
    engine.drain_kv_events()
    assert engine.reset_prefix_cache()
    assert engine.drain_kv_events() == [AllBlocksCleared()]
    engine.add_request("b2", tokens(500, 60), 1)
    _, outputs = run_to_completion(engine)
    assert outputs["b2"][0].num_cached_tokens == 0


def test_cache_salt_separates_identical_prompts() -> None:
    engine = Engine(make_profile())
    prompt = tokens(0, 64)
    engine.add_request("a", prompt, 1)
    run_to_completion(engine)
    engine.add_request("salted", prompt, 1, cache_salt="tenant-1")
    engine.add_request("plain", prompt, 1)
    _, outputs = run_to_completion(engine)
    assert outputs["salted"][0].num_cached_tokens == 0
    assert outputs["plain"][0].num_cached_tokens == 48


def test_abort_frees_blocks_and_ignores_unknown_ids() -> None:
    engine = Engine(make_profile(max_num_seqs=1))
    engine.add_request("running", tokens(0, 100), 50)
    engine.add_request("waiting", tokens(500, 100), 50)
    engine.step()
    assert engine.stats.kv_cache_usage > 0
    engine.abort_request("running")
    engine.abort_request("waiting")
    engine.abort_request("never-seen")
    engine.check_invariants()
    assert engine.stats.kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    assert engine.step().duration_s == 0.0
    engine.add_request("running", tokens(0, 10), 1)  # the id is free again


def test_jitter_is_seeded_and_bounded() -> None:
    def durations(seed: int) -> list[float]:
        engine = Engine(make_profile(), rng=random.Random(seed), jitter=0.1)
        engine.add_request("r", tokens(0, 1000), 20)
        out = []
        while engine.has_unfinished_requests():
            out.append(engine.step().duration_s)
        return out

    plain = Engine(make_profile())
    plain.add_request("r", tokens(0, 1000), 1)
    exact = plain.step().duration_s
    assert exact == pytest.approx((1 + 0.010 * 1000 + 4.4e-3) / 1000)
    first = durations(1)
    assert first == durations(1) and first != durations(2)
    assert exact * 0.9 <= first[0] <= exact * 1.1
    with pytest.raises(ValueError):
        Engine(make_profile(), jitter=1.5)


@pytest.mark.parametrize(
    ("request_id", "prompt", "max_tokens", "message"),
    [
        ("", [1, 2], 1, "request_id"),
        ("r", [], 1, "at least one token"),
        ("r", [1, 2], 0, "max_tokens"),
        ("r", [1] * 8193, 1, "longer than max_model_len"),
        ("r", [1] * 8000, 500, "exceeds max_model_len"),
        ("r", [1, "x"], 1, "integers"),
    ],
)
def test_bad_requests_raise_value_error(
    request_id: str, prompt: list, max_tokens: int, message: str
) -> None:
    engine = Engine(PROFILES["tiny"])
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, prompt, max_tokens)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused() -> None:
    engine = Engine(PROFILES["tiny"])
    engine.add_request("r", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("r", [1, 2, 3], 1)


def test_default_tokens_are_deterministic_words() -> None:
    def run() -> list[int]:
        engine = Engine(PROFILES["tiny"])
        engine.add_request("r", tokens(0, 10), 5)
        _, outputs = run_to_completion(engine)
        return [o.token_id for o in outputs["r"]]

    assert run() == run() and len(set(run())) > 1


def test_profile_type_is_exported() -> None:
    assert isinstance(PROFILES["tiny"], EngineProfile)


def test_a_span_of_built_in_tokens_equals_them_one_by_one() -> None:
    hashed = HashedTokens()
    for request_id, start, stop in [("r-1", 0, 40), ("chat-7", 13, 14), ("x", 5, 5)]:
        one_by_one = [hashed(request_id, i) for i in range(start, stop)]
        assert list(hashed.span(request_id, start, stop)) == one_by_one
        assert list(token_span(hashed, request_id, start, stop)) == one_by_one
    assert len(set(hashed.span("r-1", 0, 40))) > 1  # not one word repeated
    assert list(token_span(lambda rid, i: i * 2, "r", 3, 6)) == [6, 8, 10]  # any function
