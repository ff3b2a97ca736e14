"""The Fleet's parts on their own: the eviction arithmetic of the cost model, the engine's
prefix-cache counters, the load order."""

from __future__ import annotations

import pytest

from kvroute.core.backend import EngineCounters
from kvroute.core.cost import evicted_blocks, evicted_hot_blocks, kv_free_tokens
from kvroute.core.load_order import LoadOrder


@pytest.mark.parametrize(
    ("held", "capacity", "new", "evicted"),
    [
        (0, 10, 4, 0),  # an empty cache takes them
        (6, 10, 4, 0),  # fits exactly
        (8, 10, 4, 2),  # overflows by two
        (10, 10, 4, 4),  # full: one out per block in
        (3, 10, 40, 3),  # never more than it holds
    ],
)
def test_new_blocks_push_out_what_overflows_the_cache(held, capacity, new, evicted):
    assert evicted_blocks(held, capacity, new) == evicted


@pytest.mark.parametrize(
    ("evicted", "hot", "joining", "capacity", "out"),
    [
        (4, 5, 3, 10, 0),  # the working set and the prompt fit: only leftovers go
        (4, 8, 3, 10, 1),  # one block over
        (4, 10, 3, 10, 3),  # the whole prompt's share
        (2, 10, 3, 10, 2),  # at most what is evicted
    ],
)
def test_hot_blocks_go_only_when_the_working_set_no_longer_fits(
    evicted, hot, joining, capacity, out
):
    assert evicted_hot_blocks(evicted, hot, joining, capacity) == out


def test_free_kv_is_capacity_less_ours_less_others():
    assert kv_free_tokens(1000, 300, 0) == 700
    assert kv_free_tokens(1000, 300, 250) == 450


def test_engine_counters_sum_deltas_and_a_drop_is_a_restart():
    c = EngineCounters()
    c.observe(100, 400)  # the first scrape is the baseline
    assert (c.hit_tokens, c.query_tokens) == (0, 0)
    c.observe(150, 500)
    assert (c.hit_tokens, c.query_tokens) == (50, 100)
    c.observe(20, None)  # hits dropped: the engine restarted and has counted 20 since
    assert (c.hit_tokens, c.query_tokens) == (70, 100)
    assert (c.last_hits, c.last_queries) == (20, 500)


def test_load_order_is_per_model_least_loaded_first():
    order = LoadOrder()
    order.put("a", frozenset({"m"}), 300, 1.0, 1)
    order.put("b", frozenset(), 100, 1.0, 2)  # models unknown: serves any
    order.put("c", frozenset({"n"}), 50, 1.0, 3)
    order.put("d", frozenset({"m"}), 400, 2.0, 4)  # 200 per unit of weight
    assert list(order.urls("m")) == ["b", "d", "a"]
    assert list(order.urls("n")) == ["c", "b"]
    assert list(order.urls(None)) == ["c", "b", "d", "a"]
    assert order.mean_tokens() == pytest.approx(850 / 5.0)
    order.put("a", frozenset({"m"}), 0, 1.0, 1)  # its load changed: it moves
    order.discard("b")
    assert list(order.urls("m")) == ["a", "d"]
    assert len(order) == 3
