"""Learned prefill rates under noise: outliers move them little, real changes are followed,
and a backend with few samples stays at the fleet's rate (issue 10, deliverable 3)."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.core.cost import CostConfig, PrefillRate
from kvroute.core.policy import Decision
from tests.core.routing_helpers import chain, make_fleet, req, url

CFG = CostConfig()
TRUE_RATE = 20_000.0  # tokens/s
WORK = 4_000.0  # tokens per sample: 200 ms of service at TRUE_RATE


def ttft_at(rate: float, jitter_s: float = 0.0) -> float:
    return CFG.overhead_s + WORK / rate + jitter_s


def settled(seed: int) -> PrefillRate:
    """A fleet-level rate after 80 samples at TRUE_RATE with +-30 ms of jitter."""
    rng = random.Random(seed)
    rate = PrefillRate(CFG)
    for _ in range(80):
        rate.observe(WORK, ttft_at(TRUE_RATE, rng.uniform(-0.03, 0.03)))
    return rate


def test_jitter_of_tens_of_ms_leaves_a_settled_rate_within_a_few_percent():
    for seed in range(20):
        assert settled(seed).tokens_per_s == pytest.approx(TRUE_RATE, rel=0.05)


@pytest.mark.parametrize(("burst", "max_move"), [(1, 0.02), (3, 0.07), (5, 0.13)])
@pytest.mark.parametrize("factor", [4.0, 0.25])  # a GC pause (4x slower), or 4x too fast
def test_a_burst_of_outliers_moves_a_settled_rate_little(burst, max_move, factor):
    # Before: each outlier moved the rate by 4 ** 0.2 = 32 %, five by 2x and more.
    for seed in range(20):
        rate = settled(seed)
        before = rate.tokens_per_s
        for _ in range(burst):
            rate.observe(WORK, ttft_at(TRUE_RATE / factor))
        assert abs(math.log(rate.tokens_per_s / before)) <= math.log1p(max_move)


@pytest.mark.parametrize(("factor", "within"), [(0.5, 30), (2.0, 30), (0.25, 45), (4.0, 45)])
def test_a_sustained_change_is_followed(factor, within):
    rng = random.Random(7)
    rate = settled(7)
    new_rate = TRUE_RATE * factor
    for _ in range(within):
        rate.observe(WORK, ttft_at(new_rate, rng.uniform(-0.01, 0.01)))
    assert rate.tokens_per_s == pytest.approx(new_rate, rel=0.15)


def test_a_wrong_prior_is_left_within_a_dozen_samples():
    rate = PrefillRate(CFG)  # prior 10k tokens/s; the engine does 50k
    for _ in range(12):
        rate.observe(WORK, CFG.overhead_s + WORK / 50_000)
    assert rate.tokens_per_s == pytest.approx(50_000, rel=0.15)


def _warm(fleet, u: str, n: int, rate: float, start: float, key: int) -> None:
    for i in range(n):
        r = req(f"{u}-{key}-{i}", chain((key + i, 60)), prompt_tokens=965)
        t = fleet.dispatch(Decision(u, "test", 0, (u,)), r, start + i)
        fleet.on_first_token(t, start + i + CFG.overhead_s + 965 / rate)
        fleet.finish(t, start + i + 0.5, ok=True)


def _rate(fleet, u: str) -> float:
    return next(s.prefill_tokens_per_s for s in fleet.backend_states() if s.url == u)


def test_a_backend_with_few_samples_stays_near_the_fleet_rate():
    # Backend 1's first three samples are 3x slow (a pause while it warmed up). Before,
    # its own rate took over at the third sample and it looked 2x slower than its peers.
    fleet = make_fleet(n=2)
    _warm(fleet, url(0), 30, 30_000, 0.0, 1000)
    fleet_rate = _rate(fleet, url(1))  # no samples yet: the fleet's
    assert fleet_rate == pytest.approx(30_000, rel=0.05)
    _warm(fleet, url(1), 3, 10_000, 100.0, 5000)
    assert _rate(fleet, url(1)) >= fleet_rate * 0.9


def test_a_backend_that_is_really_slower_is_learned():
    fleet = make_fleet(n=2)
    for k in range(60):  # interleaved, as live traffic is
        _warm(fleet, url(0), 1, 30_000, 2.0 * k, 1000 + k)
        _warm(fleet, url(1), 1, 7_500, 2.0 * k + 1, 5000 + k)
    assert _rate(fleet, url(0)) == pytest.approx(30_000, rel=0.2)
    assert _rate(fleet, url(1)) == pytest.approx(7_500, rel=0.2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("rate_step", 0.0), ("rate_step", 1.5), ("rate_noise_band", 0.9), ("rate_warmup_samples", -1)],
)
def test_bad_rate_learning_config_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CostConfig(**{field: value})
