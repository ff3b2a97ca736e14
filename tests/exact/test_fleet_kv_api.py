"""What the router reads of the Fleet's exact views, through the Fleet's own methods
(/admin/kv, the status page and the KV subscriber no longer reach into its sync or index)."""

from __future__ import annotations

from kvroute.common.kv_events import BlockStored
from kvroute.core.kv_sync import KvOutcome
from tests.exact.helpers import exact_fleet, request, router_keys, stored, sync, tokens, url

A, B = url(0), url(1)


def test_confirmed_keys_are_the_events_keys_and_none_while_approximate():
    fleet = exact_fleet()
    assert fleet.confirmed_keys(A) is None  # no stream yet: approximate
    ids = tokens((1, 2), (2, 1))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(ids)], 0.0)
    assert fleet.confirmed_keys(A) == set(router_keys(ids))
    assert fleet.confirmed_keys("http://nowhere") is None


def test_kv_stream_is_a_copy_of_where_the_stream_stands():
    fleet = exact_fleet()
    sync(fleet, A)
    assert fleet.apply_kv_batch(A, 3, 2.0, [], 0.5, lag_s=0.25) is KvOutcome.GAP
    s = fleet.kv_stream(A)
    assert s is not None and (s.last_seq, s.num_gaps, s.lag_s) == (0, 1, None)
    s.last_seq = 99  # the caller's copy: the Fleet's stream does not move
    assert fleet.kv_next_seq(A) == 1
    assert fleet.kv_stream("http://nowhere") is None


def test_a_batch_announced_in_parts_counts_once_its_last_part_is_in():
    fleet = exact_fleet()
    sync(fleet, A)
    ids = tokens((1, 2))
    first, second = stored(ids, 0, 1), stored(ids, 1, 2)
    fleet.kv_expect_parts(A, 1, 2)
    assert fleet.apply_kv_batch(A, 1, 2.0, [first], 0.0) is KvOutcome.APPLIED
    assert fleet.kv_next_seq(A) == 1  # one part owed
    assert fleet.apply_kv_batch(A, 1, 2.0, [second], 0.0) is KvOutcome.APPLIED
    assert fleet.kv_next_seq(A) == 2
    assert fleet.confirmed_keys(A) == set(router_keys(ids))
    fleet.check_invariants()


def test_backend_states_at_a_time_drop_due_speculation_first():
    fleet = exact_fleet(ttl=2.0)
    sync(fleet, A)
    sync(fleet, B)
    ids = tokens((1, 3))
    d = fleet.route(request("r1", ids), 0.0)
    assert d is not None
    fleet.dispatch(d, request("r1", ids), 0.0)
    i = [A, B].index(d.backend)
    assert fleet.backend_states()[i].speculative_blocks == 3
    assert fleet.backend_states(1.0)[i].speculative_blocks == 3  # not due yet
    assert fleet.backend_states()[i].speculative_blocks == 3
    assert fleet.backend_states(2.5)[i].speculative_blocks == 0  # a page read, no traffic
    fleet.check_invariants()


def test_an_events_block_size_is_believed_until_a_scrape_says_otherwise():
    fleet = exact_fleet(mode="auto")
    ids = tokens((1, 2))  # one engine block of 8 tokens
    fleet.apply_kv_batch(A, 0, 1.0, [BlockStored([123], None, ids, 8)], 0.0)
    assert fleet.backend_states()[0].block_size == 8
    fleet.update_engine_stats(A, block_size=16)
    assert fleet.backend_states()[0].block_size == 16
