"""Load accounting (every way a request can end) and the TTFT cost model."""

from __future__ import annotations

import pytest

from kvroute.core.cost import (
    CostConfig,
    PrefillRate,
    RequestLifetime,
    admission_wait_s,
    estimate_ttft_s,
)
from kvroute.core.fleet import Fleet
from tests.core.routing_helpers import chain, make_fleet, req, serve, url


def _end_success(fleet: Fleet, t) -> None:
    fleet.on_first_token(t, 0.5, cached_tokens=0)
    fleet.finish(t, 1.0, ok=True)


def _end_error_before_first_token(fleet: Fleet, t) -> None:
    fleet.finish(t, 0.2, ok=False)


def _end_error_mid_stream(fleet: Fleet, t) -> None:
    fleet.on_first_token(t, 0.5)
    fleet.finish(t, 0.7, ok=False)


def _end_timeout(fleet: Fleet, t) -> None:
    fleet.finish(t, 300.0, ok=False)


def _end_disconnect_then_late_first_token(fleet: Fleet, t) -> None:
    fleet.finish(t, 0.1, ok=False)  # client went away
    fleet.on_first_token(t, 0.5)  # a late event must not touch the counts


def _end_double_finish(fleet: Fleet, t) -> None:
    fleet.on_first_token(t, 0.5)
    fleet.finish(t, 1.0, ok=True)
    fleet.finish(t, 1.1, ok=False)


def _end_after_backend_removed(fleet: Fleet, t) -> None:
    fleet.remove_backend(t.url)
    fleet.add_backend(t.url)  # same URL, new incarnation: the old ticket must not release it
    fleet.finish(t, 1.0, ok=True)


ENDINGS = [
    _end_success,
    _end_error_before_first_token,
    _end_error_mid_stream,
    _end_timeout,
    _end_disconnect_then_late_first_token,
    _end_double_finish,
    _end_after_backend_removed,
]


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__[5:])
def test_load_returns_to_zero_after_every_kind_of_ending(ending):
    fleet = make_fleet("least_load", n=2)
    tickets = [serve(fleet, req(f"r{i}", chain((i, 3)), max_tokens=50))[1] for i in range(6)]
    assert sum(s.in_flight_requests for s in fleet.backend_states()) == 6
    for t in tickets:
        ending(fleet, t)
        fleet.check_invariants()
    for state in fleet.backend_states():
        assert (state.in_flight_requests, state.in_flight_tokens, state.queued_prefill_tokens) == (
            0,
            0,
            0,
        )


def test_load_is_counted_at_dispatch_prefill_released_at_first_token():
    fleet = make_fleet("round_robin", n=1)
    _, t = serve(fleet, req("r", chain((1, 10)), prompt_tokens=165, max_tokens=40))
    (state,) = fleet.backend_states()
    assert (state.in_flight_requests, state.queued_prefill_tokens, state.in_flight_tokens) == (
        1,
        165,
        205,
    )
    fleet.on_first_token(t, 0.1)
    (state,) = fleet.backend_states()
    assert (state.queued_prefill_tokens, state.in_flight_tokens) == (0, 40)


def test_engine_gauges_merge_by_max_not_sum():
    fleet = make_fleet("round_robin", n=1)
    serve(fleet, req("r", chain((1, 2)), prompt_tokens=37, max_tokens=10))
    fleet.update_engine_stats(url(0), num_running=1, num_waiting=0)
    (state,) = fleet.backend_states()
    assert state.in_flight_requests == 1  # our own request, seen by the engine too
    fleet.update_engine_stats(url(0), num_running=3, num_waiting=4)
    (state,) = fleet.backend_states()
    assert state.in_flight_requests == 7  # other routers' traffic shows up
    assert state.queued_prefill_tokens > 37


def test_estimate_adds_queue_prefill_overhead_in_seconds():
    cfg = CostConfig(attention_tokens_per_pair=0.0, overhead_s=0.01, min_prefill_s=0.0)
    ttft = estimate_ttft_s(
        num_prompt_tokens=1000,
        cached_tokens=600,
        queued_prefill_tokens=2000,
        prefill_tokens_per_s=10_000,
        config=cfg,
    )
    assert ttft == pytest.approx(0.01 + 0.2 + 0.04)


def test_estimate_caps_the_hit_at_prompt_minus_one_and_adds_attention():
    cfg = CostConfig(overhead_s=0.0, min_prefill_s=0.0)
    full_hit = estimate_ttft_s(
        num_prompt_tokens=100,
        cached_tokens=100,
        queued_prefill_tokens=0,
        prefill_tokens_per_s=1000,
        config=cfg,
    )
    assert full_hit > 0  # the last token is always recomputed
    short, long = (
        estimate_ttft_s(
            num_prompt_tokens=n,
            cached_tokens=0,
            queued_prefill_tokens=0,
            prefill_tokens_per_s=10_000,
            config=cfg,
        )
        for n in (1000, 80_000)
    )
    assert long / short > 80 * 1.5  # superlinear: the quadratic attention term


def test_a_request_that_fits_pays_no_admission_wait_and_one_that_does_not_waits_lumps():
    cfg = CostConfig()
    # three running requests end at 1, 3 and 5 s and free 100, 300 and 500 tokens
    ends = [(1.0, 100.0), (3.0, 300.0), (5.0, 500.0)]
    assert admission_wait_s(100, 500, ends) == 0.0
    assert admission_wait_s(150, 100, ends) == 1.0  # 50 missing: the first to end
    assert admission_wait_s(250, 100, ends) == 3.0  # 150 missing: the first frees only 100
    assert admission_wait_s(5000, 100, ends) == 5.0  # never fits: all of them

    def estimate(
        cached: int, free: float, releases: tuple[tuple[float, float], ...] = (), revived: int = 0
    ) -> float:
        return estimate_ttft_s(
            num_prompt_tokens=2000,
            cached_tokens=cached,
            queued_prefill_tokens=0,
            prefill_tokens_per_s=10_000,
            config=cfg,
            kv_free_tokens=free,
            decode_tokens=100,
            revived_tokens=revived,
            kv_releases=releases,
        )

    # A holder full of the very prefix it would serve (running requests pin it) pays no
    # admission wait...
    assert estimate(cached=1984, free=500) == estimate(cached=1984, free=4000)
    # ...but a hit on blocks nobody pins takes them back from the free pool: it waits
    assert estimate(1984, 500, ((2.0, 3000.0),), revived=1984) - estimate(
        1984, 4000
    ) == pytest.approx(2.0)
    # a cold request that does not fit waits for a running one to end, or the configured
    # wait when the caller knows of none
    wait = estimate(cached=0, free=0, releases=((2.5, 4000.0),)) - estimate(0, 4000)
    assert wait == pytest.approx(2.5)
    assert estimate(cached=0, free=0) - estimate(0, 4000) == pytest.approx(cfg.kv_full_wait_s)


def test_the_request_lifetime_is_a_mean_of_finishes() -> None:
    life = RequestLifetime(alpha=0.5)
    assert life.mean_s is None
    life.observe(4.0)
    life.observe(float("nan"))  # not a duration: ignored
    life.observe(8.0)
    assert life.mean_s == pytest.approx(6.0)


def test_prefill_rate_learns_and_stays_bounded():
    rate = PrefillRate(CostConfig())
    for _ in range(60):
        rate.observe(work=20_000, ttft_s=0.015 + 1.0)  # 20k tokens/s
    assert rate.tokens_per_s == pytest.approx(20_000, rel=0.02)
    rate.observe(work=20_000, ttft_s=1e-6)  # impossible sample: ignored (service <= 0)
    rate.observe(work=10, ttft_s=5.0)  # too little work to tell: ignored
    assert rate.tokens_per_s == pytest.approx(20_000, rel=0.02)
    rate.observe(work=20_000_000, ttft_s=1.015)  # wild outlier moves it by a bounded factor
    assert rate.tokens_per_s < 20_000 * 4 ** CostConfig().rate_ewma_alpha * 1.01


def test_fleet_learns_the_rate_from_first_tokens():
    fleet = make_fleet("round_robin", n=1)
    for i in range(40):
        r = req(f"r{i}", chain((100 + i, 63)), prompt_tokens=1008)  # all cold
        _, t = serve(fleet, r, now=float(i))
        fleet.on_first_token(t, float(i) + 0.015 + 1008 / 5000)
        fleet.finish(t, float(i) + 0.5, ok=True)
    (state,) = fleet.backend_states()
    assert state.prefill_tokens_per_s == pytest.approx(5000, rel=0.1)
    assert state.rate_samples == 40


@pytest.mark.parametrize("field", ["rate_ewma_alpha", "kv_full_wait_s", "min_prefill_tokens_per_s"])
def test_bad_cost_config_raises_value_error_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        CostConfig(**{field: -1.0})
