"""Cache turnover, and new prompts placed where caches churn slowest."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from kvroute.core.policy import Decision
from kvroute.core.turnover import CacheTurnover
from tests.core.routing_helpers import BS, chain, make_fleet, req, serve, url


def test_turnover_counts_cache_sizes_and_decays_per_mean_fleet_turnover():
    t = CacheTurnover()
    t.add("a", 1000, 1000, num_backends=2)  # one turnover of a's cache
    assert t.of("a") == 1.0 and t.of("b") == 0.0
    t.add("b", 1000, 2000, num_backends=2)  # half of b's: the fleet's mean clock moves 1/4
    t.add("b", 10**9, 2000, num_backends=2)  # more than its cache: one turnover at most
    assert math.isclose(t.of("a"), math.exp(-0.75))  # the clock: 0.5, 0.75, 1.25
    assert math.isclose(t.of("b"), 0.5 * math.exp(-0.5) + 1)
    t.add("a", 0, 1000, num_backends=2)  # nothing added: nothing changes
    t.add("a", 10, 0, num_backends=2)  # no capacity known: ignored
    assert math.isclose(t.of("a"), math.exp(-0.75))
    t.forget("b")
    assert t.of("b") == 0.0


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 10**6)), max_size=60))
def test_turnover_is_finite_nonnegative_and_only_adds_raise_it(adds):
    t = CacheTurnover()
    for url_, tokens in adds:
        before = {u: t.of(u) for u in "abc"}
        t.add(url_, tokens, 50_000, num_backends=3)
        for u in "abc":
            assert 0.0 <= t.of(u) < math.inf
            if u != url_ or tokens == 0:
                assert t.of(u) <= before[u] + 1e-12


def test_new_prompts_spread_evenly_over_an_idle_fleet():
    fleet = make_fleet(n=8, capacity=64)
    counts: Counter[str] = Counter()
    for i in range(64):  # 64 different prompts of 32 blocks: every cache churns
        d, t = serve(fleet, req(f"p{i}", chain((1000 + i, 32))), now=float(i))
        assert d.reason == "cold"
        counts[d.backend] += 1
        fleet.finish(t, float(i) + 0.5, True)
    # by momentary queue and eviction estimates alone: 2, 3, 3, 6, 6, 13, 15, 16
    assert len(counts) == 8 and max(counts.values()) - min(counts.values()) <= 6, counts


def test_a_cache_that_churned_more_gets_the_next_new_prompt_later():
    fleet = make_fleet(n=2, capacity=100)
    busy = url(0)
    for i in range(5):  # one-off prompts keep replacing busy's cache
        t = fleet.dispatch(Decision(busy, "t", 0, (busy,)), req(f"o{i}", chain((50 + i, 60))), 0.0)
        fleet.finish(t, 0.1, True)
    assert fleet.turnover.of(busy) > fleet.turnover.of(url(1)) == 0.0
    d, _ = serve(fleet, req("new", chain((9, 20)), prompt_tokens=20 * BS + 3), now=1.0)
    assert d.backend == url(1) and d.reason == "cold"
