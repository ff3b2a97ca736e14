"""Bytes per token learned from engine usage (core/calibration.py) and what the Fleet
does with it in approximate mode: token estimates, key-block tokens, capacity."""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvroute.core.calibration import (
    HYSTERESIS,
    MAX_BYTES_PER_TOKEN,
    MIN_BYTES_PER_TOKEN,
    MIN_SAMPLE_TOKENS,
    MIN_SAMPLES,
    WINDOW,
    TextCalibration,
)
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.core.policy.base import RouteRequest

TOKENS = 1000  # prompt tokens of the observations below: far above MIN_SAMPLE_TOKENS


def observe_ratio(cal: TextCalibration, model: str | None, ratio: float) -> bool:
    return cal.observe(model, round(ratio * TOKENS), TOKENS)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=-5, max_value=1 << 40),
            st.integers(min_value=-5, max_value=1 << 40),
        ),
        max_size=150,
    )
)
def test_the_estimate_stays_bounded_whatever_engines_report(pairs: list[tuple[int, int]]) -> None:
    cal = TextCalibration()
    for text_bytes, prompt_tokens in pairs:
        cal.observe("m", text_bytes, prompt_tokens)
        for model in ("m", None, "never-seen"):
            assert MIN_BYTES_PER_TOKEN <= cal.bytes_per_token(model) <= MAX_BYTES_PER_TOKEN
        assert cal.estimate_tokens("m", 10_000) >= 1


@settings(max_examples=200, deadline=None)
@given(
    true_ratio=st.floats(min_value=1.5, max_value=8.0),
    noise=st.lists(st.floats(min_value=-0.05, max_value=0.05), min_size=WINDOW, max_size=200),
    outliers=st.lists(
        st.one_of(st.floats(min_value=0.0, max_value=1e9), st.sampled_from([0.01, 1e6])),
        max_size=200,
    ),
    where=st.randoms(use_true_random=False),
)
def test_a_minority_of_outliers_does_not_move_it_off_the_true_ratio(
    true_ratio: float, noise: list[float], outliers: list[float], where: Random
) -> None:
    """Inliers within 5 % of the true ratio, outliers anywhere (any value, any place):
    while the last WINDOW observations hold fewer than 45 % outliers, the value in use
    stays within 5 % of the truth plus the hysteresis band."""
    sequence: list[tuple[bool, float]] = [(False, true_ratio * (1 + e)) for e in noise]
    for value in outliers:
        sequence.insert(where.randrange(len(sequence) + 1), (True, value))
    last = sequence[-WINDOW:]
    assume(sum(is_outlier for is_outlier, _ in last) < 0.45 * len(last))
    cal = TextCalibration()
    for _, ratio in sequence:
        cal.observe("m", round(ratio * TOKENS), TOKENS)
    bound = (1 + 0.05) * (1 + HYSTERESIS)
    assert true_ratio / bound <= cal.bytes_per_token("m") <= true_ratio * bound


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=1.0, max_value=16.0), st.floats(min_value=1.0, max_value=16.0))
def test_it_converges_to_the_true_ratio_and_follows_a_change(first: float, second: float) -> None:
    cal = TextCalibration()
    for _ in range(WINDOW):
        observe_ratio(cal, "m", first)
    assert abs(cal.bytes_per_token("m") - first) <= 0.01 * first  # exact up to rounding
    for _ in range(WINDOW):
        observe_ratio(cal, "m", second)
    # followed, up to the band that keeps it from flickering
    assert abs(cal.bytes_per_token("m") / second - 1) <= HYSTERESIS + 0.01


def test_small_moves_inside_the_band_change_nothing() -> None:
    cal = TextCalibration()
    changes = [observe_ratio(cal, "m", 3.0) for _ in range(MIN_SAMPLES)]
    assert changes == [False] * (MIN_SAMPLES - 1) + [True]  # in use from the 4th on
    assert cal.bytes_per_token("m") == 3.0
    for i in range(200):  # +-2 %: inside the 3 % band
        assert not observe_ratio(cal, "m", 3.0 * (1.02 if i % 2 else 0.98))
    assert cal.bytes_per_token("m") == 3.0


def test_fallbacks_models_and_ignored_observations() -> None:
    cal = TextCalibration(max_models=2)
    assert cal.bytes_per_token("a") == 4.0  # the prior: the built-in tokenizer's ratio
    for _ in range(MIN_SAMPLES):
        observe_ratio(cal, "a", 3.0)
        observe_ratio(cal, "b", 5.0)
    assert (cal.bytes_per_token("a"), cal.bytes_per_token("b")) == (3.0, 5.0)
    assert cal.bytes_per_token("c") == 4.0  # unseen: the pooled median of 3s and 5s
    observe_ratio(cal, "c", 6.0)  # a third model: "a", least recently observed, goes
    assert set(cal.model_to_estimate) == {"b", "c"}
    assert cal.bytes_per_token("a") == cal.bytes_per_token(None)
    before = cal.pooled.num_samples
    assert not cal.observe("b", 100, MIN_SAMPLE_TOKENS - 1)  # mostly template: skipped
    assert not cal.observe("b", -1, 100)
    assert not cal.observe("b", True, 100)  # type: ignore[arg-type]
    assert not cal.observe("b", 100, 0)
    assert cal.pooled.num_samples == before
    with pytest.raises(ValueError, match="prior"):
        TextCalibration(prior=0.5)


def _fleet(mode: str = "approximate") -> Fleet:
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=16, mode=mode))
    fleet.add_backend("http://a", models=["m"])
    fleet.update_engine_stats("http://a", num_gpu_blocks=1000)
    return fleet


def test_the_fleet_scales_capacity_estimates_and_key_blocks_not_keys() -> None:
    fleet = _fleet()
    (s,) = fleet.backend_states()
    assert (s.capacity_blocks, s.key_capacity_blocks, s.bytes_per_token) == (1000, 1000, 4.0)
    assert fleet.prompt_tokens_estimate("m", 3000) == 750  # bytes / 4 until learned
    # fill the cache model: 1000 key blocks of 64 bytes
    keys = list(range(1, 1001))
    req = RouteRequest("r", "m", keys, num_prompt_tokens=16_000, max_tokens=1)
    fleet.finish(fleet.dispatch(fleet.route(req, 0.0), req, 0.0), 0.0, True)  # type: ignore[arg-type]
    assert fleet.index.num_blocks("http://a") == 1000
    for _ in range(MIN_SAMPLES):  # the engine counts 3 bytes per token
        fleet.observe_prompt_tokens("m", 3000, 1000)
    (s,) = fleet.backend_states()
    # a 64-byte key block is 21.3 tokens: 1000 engine blocks of 16 tokens hold 750 of them
    assert (s.capacity_blocks, s.key_capacity_blocks, s.bytes_per_token) == (1000, 750, 3.0)
    assert fleet.index.num_blocks("http://a") == 750  # the oldest key blocks left
    assert fleet.prompt_tokens_estimate("m", 3000) == 1000
    assert fleet.key_block_tokens("m", 16) == 21
    # a full hit of a 10-key-block prompt: ~213 tokens, as the engine would count them
    hit = RouteRequest("h", "m", keys[:10], num_prompt_tokens=214, max_tokens=1)
    assert fleet.predicted_cached_tokens("http://a", hit) == 210
    fleet.update_engine_stats("http://a", num_gpu_blocks=2000)  # a rescrape
    assert fleet.backend_states()[0].key_capacity_blocks == 1500
    fleet.check_invariants()


def test_a_name_no_backend_lists_teaches_only_the_pooled_estimate() -> None:
    fleet = _fleet()
    for _ in range(MIN_SAMPLES):
        fleet.observe_prompt_tokens("client-made-up", 3000, 1000)
    assert "client-made-up" not in fleet.calibration.model_to_estimate
    assert fleet.prompt_tokens_estimate("m", 3000) == 1000  # "m" has none: pooled


@pytest.mark.parametrize(("mode", "key_block_tokens"), [("exact", 16), ("auto", 21)])
def test_modes_with_token_keys_keep_engine_blocks(mode: str, key_block_tokens: int) -> None:
    fleet = _fleet(mode)
    for _ in range(MIN_SAMPLES):
        fleet.observe_prompt_tokens("m", 3000, 1000)
    (s,) = fleet.backend_states()
    assert (s.capacity_blocks, s.key_capacity_blocks) == (1000, 1000)
    # auto mode keys text until a backend of the model is synced
    assert fleet.key_kind_for("m") == ("tokens" if mode == "exact" else "text")
    assert fleet.key_block_tokens("m", 16) == key_block_tokens
    assert fleet.prompt_tokens_estimate("m", 3000) == 1000


def test_a_first_estimate_over_the_context_may_still_be_cached() -> None:
    """Before any answer the token estimate divides by the built-in 4 bytes a token, and
    text runs 4-5: a prompt estimated up to a quarter over the context may fit, so its
    blocks go to the cache model (ranvier-stress's 8,055-token prompts, estimated at 9,603
    on an 8,192-token context, were left out and scattered). Once the ratio is learned,
    the estimate is taken as it is; token keys count exactly."""
    fleet = _fleet()
    assert not fleet.prompt_tokens_learned("m")
    assert fleet.cacheable("m", 9_603, 8_192)  # 17 % over, on the built-in ratio
    assert not fleet.cacheable("m", 10_300, 8_192)  # over by more than the slack
    assert fleet.cacheable("m", 9_603, None)  # no known context: nothing is too long
    for _ in range(MIN_SAMPLES):
        fleet.observe_prompt_tokens("m", 3000, 1000)
    assert fleet.prompt_tokens_learned("m")
    assert not fleet.cacheable("m", 8_192, 8_192)  # vLLM keeps room for one output token
    assert fleet.cacheable("m", 8_191, 8_192)
    exact = _fleet("exact")
    assert not exact.prompt_tokens_learned("m")
    assert not exact.cacheable("m", 8_192, 8_192)  # the engine's own count: no slack
