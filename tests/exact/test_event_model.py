"""EventCacheModel stories: engine hashes -> router keys, removal, clear, gaps in chains."""

from __future__ import annotations

from kvroute.common.hashing import chain_seed, token_block_hashes
from kvroute.common.kv_events import BlockStored
from kvroute.core.event_model import EventCacheModel
from tests.exact.helpers import BS, engine_hashes, router_keys, stored, tokens


def test_engine_hashes_with_another_seed_map_to_router_keys():
    ids = tokens((1, 3))
    m = EventCacheModel(100)
    added = m.store(*_fields(stored(ids)))
    keys = router_keys(ids)
    assert added == keys
    assert engine_hashes(ids) != keys  # the engine's hashes really differ
    assert [m.key_of(h) for h in engine_hashes(ids)] == keys
    m.check_invariants()


def test_a_child_event_chains_through_the_parents_router_key():
    ids = tokens((1, 2), (2, 2))
    m = EventCacheModel(100)
    m.store(*_fields(stored(ids, 0, 2)))
    added = m.store(*_fields(stored(ids, 2)))
    assert added == router_keys(ids)[2:]
    assert set(m.blocks()) == set(router_keys(ids))


def test_removed_engine_hash_maps_back_and_hides_its_descendants():
    ids = tokens((1, 4))
    keys, hashes = router_keys(ids), engine_hashes(ids)
    m = EventCacheModel(100)
    m.store(*_fields(stored(ids)))
    assert m.remove([hashes[3]]) == [keys[3]]
    # a middle block goes: its child is still held by the engine but no longer reachable
    assert sorted(m.remove([hashes[1]])) == sorted(keys[1:3])
    assert m.holds(keys[0]) and not m.holds(keys[2])
    assert m.num_confirmed == 2  # keys 0 and 2 (2 is held, just invisible)
    m.check_invariants()
    # the parent is stored again (same tokens): the child reappears with it
    assert sorted(m.store(*_fields(stored(ids, 1, 2)))) == sorted(keys[1:3])
    m.check_invariants()


def test_unknown_parent_is_an_orphan_and_unknown_removal_is_ignored():
    ids = tokens((7, 3))
    m = EventCacheModel(100)
    assert m.store(*_fields(stored(ids, 1))) == []
    assert m.num_orphans == 2 and len(m) == 0
    assert m.remove([12345]) == []
    m.check_invariants()


def test_clear_drops_confirmed_blocks():
    ids = tokens((1, 2))
    m = EventCacheModel(100)
    m.store(*_fields(stored(ids)))
    assert sorted(m.clear()) == sorted(router_keys(ids))
    assert len(m) == 0
    m.check_invariants()


def test_speculation_is_confirmed_by_a_store_and_then_survives_withdrawal():
    ids = tokens((3, 3))
    keys = router_keys(ids)
    m = EventCacheModel(100)
    assert m.speculate(keys, 7) == keys
    assert m.num_speculative == 3
    assert m.store(*_fields(stored(ids, 0, 2))) == []  # already visible, now confirmed
    assert m.unspeculate(keys, 7) == [keys[2]]  # only the unconfirmed block goes
    assert set(m.blocks()) == set(keys[:2])
    m.check_invariants()


def test_withdrawing_one_speculation_keeps_anothers():
    """Request 1 speculates while its blocks are confirmed; they are evicted; request 2
    speculates them again: request 1's expiry must not take back request 2's credit."""
    ids = tokens((4, 2))
    keys = router_keys(ids)
    m = EventCacheModel(100)
    event = stored(ids)
    m.store(*_fields(event))
    assert m.speculate(keys, 1) == []  # held already: nothing new
    assert sorted(m.remove(event.block_hashes)) == sorted(keys)
    assert m.speculate(keys, 2) == keys
    assert m.speculate(keys, 3) == []  # a third request with the same prompt
    assert m.unspeculate(keys, 1) == []
    assert m.unspeculate(keys, 2) == []  # request 3 still pending
    assert set(m.blocks()) == set(keys)
    assert sorted(m.unspeculate(keys, 3)) == sorted(keys)
    assert len(m) == 0
    m.check_invariants()


def test_children_come_before_parents_in_blocks_order():
    ids = tokens((1, 3))
    other = tokens((1, 1), (9, 2))
    m = EventCacheModel(100)
    m.store(*_fields(stored(ids)))
    m.store(*_fields(stored(other, 1)))
    order = list(m.blocks())
    for chain in (router_keys(ids), router_keys(other)):
        positions = [order.index(k) for k in chain]
        assert positions == sorted(positions, reverse=True)


def _fields(e: BlockStored):
    assert e.block_size == BS
    return e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size


def test_a_salted_chain_is_keyed_from_its_salt_and_its_seed_goes_with_it():
    ids = tokens((1, 3))
    salt = chain_seed("tenant-a")
    salted_engine_hashes = token_block_hashes(ids, BS, 12345)  # the engine mixed the salt in
    m = EventCacheModel(100)
    plain = m.store(*_fields(stored(ids)))
    salted = m.store(salted_engine_hashes, None, ids, BS, salt)  # same tokens, other chain
    assert salted == token_block_hashes(ids, BS, salt)
    assert not set(plain) & set(salted)
    assert set(m.blocks()) == set(plain) | set(salted)  # both chains start at a root
    m.check_invariants()
    assert sorted(m.remove(salted_engine_hashes[1:2])) == sorted(salted[1:])
    m.check_invariants()
    m.clear()
    assert len(m) == 0
    m.check_invariants()  # no salted seed outlives its blocks


def test_retired_mappings_are_bounded_by_the_engines_capacity():
    """Removed engine hashes are remembered for children stored late, but only about an
    engine's capacity of them: a fixed 65,536 per engine grew a soak's router by ~25 MiB
    long after warm-up."""
    from kvroute.core.event_model import RETIRED_MIN

    m = EventCacheModel(100)
    for v in range(3 * RETIRED_MIN):  # store and evict many distinct one-block prompts
        ids = tokens((v + 10, 1))
        m.store(*_fields(stored(ids)))
        m.remove(engine_hashes(ids))
    assert len(m._retired) == m.retired_limit == RETIRED_MIN
    # the most recently removed parent still chains a late child
    ids = tokens((3 * RETIRED_MIN + 9, 1), (5, 1))
    m.store(*_fields(stored(ids, 0, 1)))
    m.remove(engine_hashes(ids)[:1])
    assert m.store(*_fields(stored(ids, 1))) == []  # invisible: its parent is gone
    assert m.key_of(engine_hashes(ids)[1]) == router_keys(ids)[1]
    m.set_capacity(RETIRED_MIN // 2)  # a smaller engine keeps no more than the floor
    assert len(m._retired) == RETIRED_MIN
    m.check_invariants()
