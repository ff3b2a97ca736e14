"""Issue 9, finding 8 (pure parts): the decoder's limits, batches applied in parts, and
the caps on the exact views."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.kv_events import (
    AllBlocksCleared,
    BatchReader,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventLimits,
    decode_batch,
    encode_batch,
    event_work,
    split_events,
)
from kvroute.core.config import FleetConfig
from kvroute.core.event_model import EventCacheModel
from kvroute.core.fleet import Fleet
from kvroute.core.index import LruCacheModel, PrefixIndex
from kvroute.core.kv_sync import ExactSync, KvOutcome
from kvroute.core.policy import make_policy
from tests.exact.helpers import BS, engine_hashes, router_keys, stored, tokens

SMALL = KvEventLimits(
    max_events=4, max_blocks=6, max_blocks_per_event=4, max_tokens_per_event=16, max_block_size=8
)


def pack(*events: object, ts: object = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events)])


@pytest.mark.parametrize(
    "payload",
    [
        pack([["BlockStored"], [1], None, [1, 2], 2]),  # a list as tag
        pack({"type": {"x": 1}, "block_hashes": [1]}),  # a map as tag
        pack(["BlockStored", [1], None, [1, 2], float("inf")]),
        pack(["BlockStored", [1], None, [1, 2], 2**64 - 1]),  # huge block size
        pack(["BlockStored", [1], None, [1, 2], -3]),
        pack(["BlockStored", [1], None, [1, 2], True]),
        pack(["BlockStored", [1], None, [1, float("nan")], 2]),
        pack(["BlockStored", [1], None, [[1], [2]], 2]),
        pack(["BlockStored", [1], None, "12", 2]),
        pack(["BlockStored", [1], [2], [1, 2], 2]),  # a list as parent hash
        pack(["BlockStored", [1], None, [1, 2], 2, "lora"]),  # lora_id must be an int
        pack(["BlockStored", [1], None, [1, 2], 2, None, 7]),  # medium must be a string
        pack(["BlockStored", [1], None, [1, 2], 2, None, "GPU", 5]),  # lora_name
        pack(["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, {"a": 1}]),
        pack(["BlockRemoved", [None]]),
        pack(["BlockRemoved", {"1": 2}]),
        pack(["BlockRemoved"]),
        pack(["AllBlocksCleared"], ts=float("inf")),
        pack(["AllBlocksCleared"], ts=[1.0]),
        pack(["AllBlocksCleared"], ts=True),
        pack(*[["AllBlocksCleared"]] * 5),  # max_events
        pack(["BlockRemoved", [1, 2, 3, 4, 5]]),  # max_blocks_per_event
        pack(["BlockRemoved", [1, 2, 3]], ["BlockRemoved", [4, 5, 6, 7]]),  # max_blocks
        pack(["BlockStored", [1, 2, 3], None, list(range(17)), 8]),  # max_tokens_per_event
        pack(["BlockStored", [1], None, [1], 9]),  # max_block_size
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode([[[[[[[[[[[]]]]]]]]]]]),
        b"\x92\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\xdd\xff\xff\xff\xff",  # huge array header
        # nested past msgspec's depth limit (RecursionError): as timestamp, as an event
        pytest.param(b"\x92" + b"\x91" * 200_000 + b"\x01\x90", id="deep-ts"),
        pytest.param(b"\x92\x01\x91" + b"\x91" * 200_000 + b"\x90", id="deep-event"),
    ],
)
def test_malformed_or_oversized_batches_raise_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload, SMALL)


def test_within_the_limits_everything_decodes_and_reads_in_slices() -> None:
    events: list[KvEvent] = [
        BlockStored([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, lora_id=3, lora_name="a"),
        BlockRemoved([1]),
        AllBlocksCleared(),
        BlockStored([9], 2, [1, 2, 3], 4, extra_keys=[["salt"]]),  # a short token list
    ]
    payload = encode_batch(2.0, events)
    assert decode_batch(payload, SMALL) == (2.0, events)
    reader = BatchReader(payload, SMALL)
    read = [reader.read(1) for _ in range(4)]
    assert [len(r) for r in read] == [1, 1, 1, 1] and reader.remaining == 0
    assert [e for r in read for e in r] == events
    assert BatchReader(payload, SMALL).read(2) == events[:1]  # one event of two blocks


def big_blocks(n: int, block_size: int) -> BlockStored:
    """One chain of ``n`` blocks of ``block_size`` tokens (distinct ids)."""
    ids = list(range(1, n * block_size + 1))
    return BlockStored(list(range(100, 100 + n)), None, ids, block_size)


def test_big_blocks_are_read_and_split_by_their_tokens_not_their_count() -> None:
    """Blocks of 64 tokens are 4 units of work each (16 tokens a unit): a slice of 8 units
    holds 2 of them, so a batch of huge blocks never holds the loop in one slice."""
    events: list[KvEvent] = [big_blocks(1, 64) for _ in range(5)]
    reader = BatchReader(encode_batch(1.0, events))
    assert [len(reader.read(8)) for _ in range(3)] == [2, 2, 1]
    parts = list(split_events([big_blocks(6, 64)], 8))
    assert [len(p[0].block_hashes) for p in parts] == [2, 2, 2]
    assert [len(p[0].token_ids) for p in parts] == [128, 128, 128]
    whole, split = EventCacheModel(100), EventCacheModel(100)
    apply_all(whole, [big_blocks(6, 64)])
    apply_all(split, [e for p in parts for e in p])
    assert split.visible == whole.visible and len(whole.visible) == 6


def chain_events(draw: st.DrawFn) -> list[KvEvent]:
    """A story of stored chains (each a few segments, parent first) and removals."""
    out: list[KvEvent] = []
    known: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        value = draw(st.integers(1, 5))
        ids = tokens((value, draw(st.integers(1, 9))))
        if draw(st.booleans()) and known:
            out.append(BlockRemoved(draw(st.lists(st.sampled_from(known), max_size=4))))
        cut = draw(st.integers(0, len(ids) // BS))
        if cut:
            out.append(stored(ids, 0, cut))
        if cut < len(ids) // BS:
            out.append(stored(ids, cut))
        known += engine_hashes(ids)
    return out


def apply_all(model: EventCacheModel, events: list[KvEvent]) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            model.store(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
        elif isinstance(e, BlockRemoved):
            model.remove(e.block_hashes)
        else:
            model.clear()


@settings(max_examples=150, deadline=None)
@given(st.composite(chain_events)(), st.integers(1, 5))
def test_events_split_into_parts_apply_as_the_whole(events, max_blocks):
    parts = list(split_events(events, max_blocks))
    assert all(sum(len(getattr(e, "block_hashes", [0])) for e in p) <= max_blocks for p in parts)
    whole, split = EventCacheModel(100), EventCacheModel(100)
    apply_all(whole, events)
    apply_all(split, [e for p in parts for e in p])
    split.check_invariants()
    assert split.visible == whole.visible
    assert split.confirmed_keys() == whole.confirmed_keys()


URL_A, URL_B = "http://a:8000", "http://b:8000"


def sync_of(max_entries: int = 1000, max_stored: int | None = None) -> ExactSync:
    index = PrefixIndex(max_entries)
    sync = ExactSync(index, "exact", 3.0, max_stored)
    for u in (URL_A, URL_B):
        index.add_backend(u, LruCacheModel(100))
        sync.add_backend(u)
        assert sync.apply_batch(u, 0, 1.0, [], None) is KvOutcome.APPLIED
        assert sync.is_exact(u)
    return sync


def test_a_batch_in_parts_applies_like_one_batch():
    sync = sync_of()
    a = tokens((1, 6))
    parts = list(split_events([stored(a)], 2))
    assert len(parts) == 3
    sync.expect_parts(URL_A, 1, 3)
    s = sync.url_to_stream[URL_A]
    for k, part in enumerate(parts):
        assert s.next_seq == 1  # not applied before its last part
        assert sync.apply_batch(URL_A, 1, 2.0, part, None) is KvOutcome.APPLIED
        assert sync.index.matched_blocks(URL_A, router_keys(a)) == 2 * (k + 1)
    assert (s.last_seq, s.parts_left, s.num_batches) == (1, 0, 2)
    assert sync.apply_batch(URL_A, 1, 2.0, parts[0], None) is KvOutcome.DUPLICATE
    sync.check_invariants()


def test_a_batch_cut_short_is_a_lost_batch():
    sync = sync_of()
    a = tokens((1, 6))
    parts = list(split_events([stored(a)], 2))
    sync.expect_parts(URL_A, 1, 3)
    sync.apply_batch(URL_A, 1, 2.0, parts[0], None)
    sync.gap_unfilled(URL_A, 2)  # the caller gave up on the rest
    assert not sync.is_exact(URL_A)
    assert sync.url_to_stream[URL_A].next_seq == 2
    sync.check_invariants()


def test_a_new_batch_while_parts_are_owed_drops_the_view():
    sync = sync_of()
    parts = list(split_events([stored(tokens((1, 6)))], 2))
    sync.expect_parts(URL_A, 1, 3)
    sync.apply_batch(URL_A, 1, 2.0, parts[0], None)
    assert sync.apply_batch(URL_A, 2, 3.0, [], None) is KvOutcome.APPLIED  # 1 is lost
    assert not sync.is_exact(URL_A)
    assert sync.url_to_stream[URL_A].last_seq == 2
    sync.check_invariants()


def test_an_announcement_is_used_by_the_next_call_only():
    sync = sync_of()
    sync.expect_parts(URL_A, 5, 3)  # for a batch that never comes
    sync.apply_batch(URL_A, 1, 2.0, [], None)
    sync.apply_batch(URL_A, 2, 3.0, [], None)
    assert sync.url_to_stream[URL_A].parts_left == 0 and sync.is_exact(URL_A)


def test_one_exact_view_is_capped():
    sync = sync_of(max_stored=10)
    sync.apply_batch(URL_A, 1, 2.0, [stored(tokens((1, 8)))], None)
    assert sync.is_exact(URL_A)
    sync.apply_batch(URL_A, 2, 3.0, [stored(tokens((2, 3)))], None)  # 11 > 10
    assert not sync.is_exact(URL_A) and sync.url_to_stream[URL_A].num_overflows == 1
    sync.check_invariants()
    a = tokens((3, 4))
    sync.apply_batch(URL_A, 3, 4.0, [AllBlocksCleared(), stored(a)], None)  # a reset
    assert sync.is_exact(URL_A) and sync.index.matched_blocks(URL_A, router_keys(a)) == 4


def test_all_exact_views_together_stay_under_the_index_cap():
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=BS, mode="exact",
                                                      max_index_entries=20))  # fmt: skip
    for u in (URL_A, URL_B):
        fleet.add_backend(u)
        fleet.apply_kv_batch(u, 0, 1.0, [], 0.0)
    fleet.apply_kv_batch(URL_A, 1, 2.0, [stored(tokens((1, 12)))], 0.0)
    fleet.apply_kv_batch(URL_B, 1, 2.0, [stored(tokens((2, 6)))], 0.0)
    assert fleet.is_exact(URL_A) and fleet.is_exact(URL_B)
    fleet.apply_kv_batch(URL_B, 2, 3.0, [stored(tokens((3, 3)))], 0.0)  # 12 + 6 + 3 > 20
    assert fleet.is_exact(URL_A) and not fleet.is_exact(URL_B)
    assert fleet.index.num_entries <= 20
    fleet.check_invariants()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=5),  # blocks per chain
    st.sampled_from([16, 32, 64, 256]),  # tokens per block
    st.integers(1, 20),  # work per part
)
def test_big_block_chains_split_by_work_apply_as_the_whole(
    chains: list[int], block_size: int, max_work: int
) -> None:
    events: list[KvEvent] = []
    for c, n in enumerate(chains):
        ids = [c * 10_000 + i for i in range(n * block_size)]
        events.append(BlockStored(list(range(c * 100, c * 100 + n)), None, ids, block_size))
    parts = list(split_events(events, max_work))
    for part in parts:  # within the budget, or one piece of one block that alone is over it
        assert sum(event_work(e) for e in part) <= max_work or (
            len(part) == 1 and len(part[0].block_hashes) == 1  # type: ignore[union-attr]
        )
    whole, split = EventCacheModel(1000), EventCacheModel(1000)
    apply_all(whole, events)
    apply_all(split, [e for p in parts for e in p])
    assert split.visible == whole.visible
