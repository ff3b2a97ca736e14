"""Stores and removals the router cannot key as its requests, or that belong to another
KV cache group of a hybrid model: skipped, so the exact view keeps what the engine hits.

vLLM 0.34 (v1/core/block_pool.py) publishes a hybrid model's blocks once per KV cache
group, under the same hashes, and a sliding-window group drops blocks the full-attention
group keeps; SGLang (srt/mem_cache/events.py) publishes a node's last page short.
"""

from __future__ import annotations

import dataclasses

from kvroute.common.kv_events import BlockRemoved, BlockStored
from tests.exact.helpers import (
    BS,
    engine_hashes,
    exact_fleet,
    router_keys,
    stored,
    sync,
    tokens,
    url,
)

A = url(0)


def _grouped(event: BlockStored, group: int, kind: str | None) -> BlockStored:
    return dataclasses.replace(event, group_idx=group, kv_cache_spec_kind=kind)


def test_a_sliding_window_groups_removals_leave_the_full_attention_blocks() -> None:
    fleet = exact_fleet()
    sync(fleet, A)
    ids = tokens((1, 3))
    full = _grouped(stored(ids), 0, "full_attention")
    window = _grouped(stored(ids), 1, "sliding_window")
    fleet.apply_kv_batch(A, 1, 2.0, [full, window], 0.0)
    assert fleet.confirmed_keys(A) == set(router_keys(ids))
    # the window slides: group 1 frees its first two blocks, group 0 keeps them
    gone = BlockRemoved(engine_hashes(ids)[:2], group_idx=1)
    fleet.apply_kv_batch(A, 2, 3.0, [gone], 0.0)
    assert fleet.confirmed_keys(A) == set(router_keys(ids))
    fleet.apply_kv_batch(A, 3, 4.0, [dataclasses.replace(gone, group_idx=0)], 0.0)
    assert fleet.confirmed_keys(A) == {router_keys(ids)[2]}
    fleet.check_invariants()


def test_the_full_attention_group_is_followed_whatever_its_index() -> None:
    fleet = exact_fleet()
    sync(fleet, A)
    first, second = tokens((1, 2)), tokens((2, 2))
    fleet.apply_kv_batch(A, 1, 2.0, [_grouped(stored(first), 0, "sliding_window")], 0.0)
    fleet.apply_kv_batch(A, 2, 3.0, [_grouped(stored(second), 1, "full_attention")], 0.0)
    assert fleet.confirmed_keys(A) == set(router_keys(second))


def test_stores_of_another_block_size_or_with_unpaired_tokens_are_skipped() -> None:
    fleet = exact_fleet()
    sync(fleet, A)
    ids = [*tokens((1, 2)), 7, 7]  # two full blocks and a short last page
    hashes = engine_hashes(ids)
    full = BlockStored(hashes[:2], None, ids[: 2 * BS], BS)
    short = BlockStored([12345], hashes[1], ids[2 * BS :], 2)  # SGLang's last page
    # token ids for three blocks behind two hashes: which token goes with which block?
    unpaired = BlockStored([777, 778], None, tokens((3, 3)), BS)
    fleet.apply_kv_batch(A, 1, 2.0, [full, short, unpaired], 0.0)
    assert fleet.confirmed_keys(A) == set(router_keys(ids[: 2 * BS]))
    stream = fleet.kv_stream(A)
    assert stream is not None and stream.num_skipped == 2
    fleet.check_invariants()
