"""Block manager stories with tiny numbers (block size 16, 10 blocks): exact block ids,
ref counts and free-queue order after each operation."""

from __future__ import annotations

import pytest

from kvroute.common.kv_events import BlockRemoved, BlockStored
from kvroute.engine.block_manager import BlockManager, PrefixHit

from .helpers import make_request, tokens


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(10, 16, enable_events=True)


def admit(bm: BlockManager, req, num_new: int | None = None) -> PrefixHit:
    hit = bm.lookup(req)
    n = req.num_tokens - hit.num_tokens if num_new is None else num_new
    assert bm.allocate(req, hit, n)
    bm.check_invariants()
    return hit


def test_shared_prefix_story(bm: BlockManager) -> None:
    a = make_request("a", tokens(0, 40))  # 2 full blocks + 8 tokens
    assert admit(bm, a) == PrefixHit((), 0)
    assert a.block_table == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]
    stored = bm.drain_events()
    assert stored == [BlockStored(a.block_hashes[:2], None, tokens(0, 32), 16)]

    b = make_request("b", [*tokens(0, 32), *tokens(500, 8)])  # same two full blocks
    assert admit(bm, b) == PrefixHit((0, 1), 32)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 32
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    bm.check_invariants([a.block_table, b.block_table])

    bm.free(a)
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    bm.free(b)  # tail first: 3, then 1 and 0 whose last holder left
    assert bm.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert bm.cached_block(a.block_hashes[0]) == 0  # kept after free
    bm.check_invariants([])

    c = make_request("c", tokens(0, 48))  # revives 0 and 1 from the free queue
    assert admit(bm, c) == PrefixHit((0, 1), 32)
    assert c.block_table == [0, 1, 4]
    assert bm.free_block_ids() == [5, 6, 7, 8, 9, 2, 3]
    assert bm.drain_events() == [
        BlockStored(c.block_hashes[2:3], c.block_hashes[1], tokens(32, 16), 16)
    ]
    bm.free(c)
    assert bm.free_block_ids() == [5, 6, 7, 8, 9, 2, 3, 4, 1, 0]

    d = make_request("d", tokens(1000, 113))  # needs 8 blocks: evicts c's tail block 4
    admit(bm, d)
    assert d.block_table == [5, 6, 7, 8, 9, 2, 3, 4]
    events = bm.drain_events()
    assert events[0] == BlockRemoved([c.block_hashes[2]])
    assert bm.cached_block(c.block_hashes[2]) is None
    assert bm.cached_block(c.block_hashes[0]) == 0  # the shared head survives
    bm.free(d)
    assert admit(bm, make_request("e", tokens(0, 40))) == PrefixHit((0, 1), 32)


def test_full_hit_recomputes_last_block(bm: BlockManager) -> None:
    """A prompt that is exactly its cached blocks keeps the last block to compute (vLLM)."""
    a = make_request("a", tokens(0, 32))
    admit(bm, a)
    bm.free(a)
    again = make_request("a2", tokens(0, 32))
    assert bm.lookup(again) == PrefixHit((0,), 16)
    longer = make_request("a3", tokens(0, 33))
    assert bm.lookup(longer) == PrefixHit((0, 1), 32)


def test_allocate_refuses_without_changing_state(bm: BlockManager) -> None:
    a = make_request("a", tokens(0, 150))  # 10 blocks: the whole cache
    admit(bm, a)
    b = make_request("b", tokens(500, 10))
    assert not bm.allocate(b, bm.lookup(b), 10)
    assert b.block_table == [] and bm.num_free_blocks == 0
    a.num_computed_tokens = 150
    assert not bm.append_slots(a, 11)  # 161 tokens would need an 11th block
    assert bm.append_slots(a, 10)  # 160 tokens still fit
    bm.check_invariants([a.block_table])


def test_chunked_allocation_caches_blocks_as_they_fill(bm: BlockManager) -> None:
    a = make_request("a", tokens(0, 40))
    hit = bm.lookup(a)
    assert bm.allocate(a, hit, 20)  # first chunk: 20 tokens, 1 full block
    assert a.block_table == [0, 1] and a.num_cached_blocks == 1
    a.num_computed_tokens = 20
    assert bm.append_slots(a, 20)
    assert a.block_table == [0, 1, 2] and a.num_cached_blocks == 2
    assert [e.block_hashes for e in bm.drain_events()] == [a.block_hashes[:1], a.block_hashes[1:2]]


def test_duplicate_block_stays_unhashed(bm: BlockManager) -> None:
    """Two requests computing the same block at once: the first one cached is found."""
    a = make_request("a", tokens(0, 20))
    b = make_request("b", tokens(0, 20))
    admit(bm, a)
    hit_b = PrefixHit((), 0)  # b looked up before a's block was cached
    assert bm.allocate(b, hit_b, 20)
    assert bm.cached_block(a.block_hashes[0]) == a.block_table[0]
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.check_invariants([a.block_table, b.block_table])


def test_reset_refused_while_in_use(bm: BlockManager) -> None:
    a = make_request("a", tokens(0, 40))
    admit(bm, a)
    assert not bm.reset()
    bm.free(a)
    bm.drain_events()
    assert bm.reset()
    assert bm.lookup(make_request("x", tokens(0, 40))) == PrefixHit((), 0)
    assert [type(e).__name__ for e in bm.drain_events()] == ["AllBlocksCleared"]
    bm.check_invariants([])


def test_no_events_unless_enabled() -> None:
    bm = BlockManager(10, 16)
    admit(bm, make_request("a", tokens(0, 40)))
    assert bm.drain_events() == []


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_blocks_are_made_when_first_handed_out_and_fresh_ones_go_first(bm: BlockManager) -> None:
    assert bm.blocks == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    a = make_request("a", tokens(0, 40))
    admit(bm, a)
    assert [b.block_id for b in bm.blocks] == [0, 1, 2]  # only what a holds exists
    bm.free(a)  # tail first to the queue's end, behind the never-used blocks
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_request("b", tokens(1000, 16 * 9))  # nine blocks: the seven fresh, then 2, 1
    admit(bm, b)
    assert b.block_table == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert bm.free_block_ids() == [0] and len(bm.blocks) == 10
    bm.check_invariants([b.block_table])
