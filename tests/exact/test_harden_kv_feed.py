"""Issue 9, finding 8: the KV event feed survives malformed and oversized input, over real
ZMQ (a ``KvEventPublisher`` sending raw payloads on its numbered stream)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, BlockStored
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.sim.kv_publisher import KvEventPublisher
from tests.conftest import until
from tests.exact.helpers import BS, ENGINE_SEED, router_keys, stored, tokens

URL = "http://engine:8000"


def fleet_of(max_entries: int = 2_000_000) -> Fleet:
    config = FleetConfig(default_block_size=BS, mode="exact", max_index_entries=max_entries)
    fleet = Fleet(make_policy("prefix"), config)
    fleet.add_backend(URL)
    return fleet


@pytest.fixture
async def pub() -> AsyncIterator[KvEventPublisher]:
    p = KvEventPublisher("tcp://127.0.0.1:0")
    try:
        yield p
    finally:
        await p.close()


async def joined(pub: KvEventPublisher, fleet: Fleet) -> None:
    """Publish resets until the SUB has joined and the backend is exact (slow joiner)."""
    for _ in range(500):
        pub.publish([AllBlocksCleared()])
        await asyncio.sleep(0.01)
        if fleet.is_exact(URL):
            return
    raise AssertionError("subscriber never joined")


def msgpack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


# Each payload goes out as a numbered batch [topic, seq, payload]: all must be skipped.
MALFORMED = [
    b"\x00garbage\xff",  # not msgpack
    msgpack({"ts": 1.0}),  # not [ts, events]
    msgpack([1.0, [[["BlockStored"], [1], None, [1, 2, 3, 4], 4]]]),  # a list as tag
    msgpack([1.0, [{"type": ["BlockRemoved"], "block_hashes": [1]}]]),  # a list as map tag
    msgpack([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], float("inf")]]]),  # block_size=inf
    msgpack([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], float("nan")]]]),
    msgpack([1.0, [["BlockStored", [1], None, [1.5, 2, 3, 4], 4]]]),  # a float token
    msgpack([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0]]]),  # block_size 0
    msgpack([float("nan"), [["AllBlocksCleared"]]]),  # NaN timestamp
    msgpack([1.0, [["BlockStored", [1], None, [[1]] * 4, 4]]]),  # nested lists as tokens
    msgpack([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", ["x"]]]]),
    msgpack([1.0, [["BlockRemoved", [True]]]]),  # a bool hash
    msgpack([1.0, [["AllBlocksCleared"]] * 70_000]),  # more events than a batch may hold
    b"\x92" + b"\x91" * 200_000 + b"\x01\x90",  # nested past msgspec's depth limit
    b"\x92\x01\x91" + b"\x91" * 200_000 + b"\x90",  # an event nested as deep
]


async def test_malformed_batches_are_skipped_counted_and_exact_mode_recovers(pub):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    await sub.start()
    try:
        await joined(pub, fleet)
        a = tokens((1, 2))
        pub.publish([stored(a)])
        await until(lambda: fleet.index.matched_blocks(URL, router_keys(a)) == 2)
        for payload in MALFORMED:
            pub._send(payload)
        pub._send_frames([b"kv-events", b"\x00\x01", b"short seq"])  # not a numbered batch
        pub._send_frames([b"only one frame"])
        await until(lambda: sub.status(URL).num_malformed_batches == len(MALFORMED))
        await until(lambda: sub.status(URL).num_bad_messages == 2)  # sent after them
        status = sub.status(URL)
        assert status.running and status.num_feed_restarts == 0
        assert not fleet.is_exact(URL)  # the view missed batches: not trusted any more
        fleet.check_invariants()
        b = tokens((3, 2))
        pub.publish([AllBlocksCleared(), stored(b)])  # the engine's next reset
        await until(lambda: fleet.is_exact(URL))
        await until(lambda: fleet.index.matched_blocks(URL, router_keys(b)) == 2)
        assert fleet.index.matched_blocks(URL, router_keys(a)) == 0
        fleet.check_invariants()
    finally:
        await sub.stop()


async def test_a_failed_feed_restarts_with_backoff_and_logs(pub, caplog):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint}, restart_backoff_s=(0.01, 0.05))
    await sub.start()
    try:
        await joined(pub, fleet)
        feed = sub._feeds[URL]
        with caplog.at_level(logging.WARNING, logger="kvroute.router.kv_subscriber"):
            assert feed.sock is not None
            feed.sock.close(linger=0)  # its receive fails under it, as on a socket error
            await until(lambda: sub.status(URL).num_feed_restarts == 1)
            await until(lambda: feed.sock is not None)  # a new run with a new socket
        assert "restart 1" in caplog.text
        assert "NoneType: None" not in caplog.text  # a socket error: no traceback at all
        assert sub.status(URL).running
        a = tokens((4, 3))
        for _ in range(500):  # the new SUB joins late: resend until a batch arrives
            pub.publish([stored(a)])
            await asyncio.sleep(0.01)
            if fleet.kv_next_seq(URL) == pub._seq:
                break
        # whether batches were lost while it rejoined (a gap) or not, a reset resyncs
        pub.publish([AllBlocksCleared(), stored(a)])
        await until(lambda: fleet.index.matched_blocks(URL, router_keys(a)) == 3)
        assert sub.status(URL).num_feed_restarts == 1
    finally:
        await sub.stop()


async def test_a_feed_failing_on_a_bug_logs_its_traceback(pub, caplog):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint}, restart_backoff_s=(0.01, 0.05))

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the feed")

    sub._handle = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="kvroute.router.kv_subscriber"):
        await sub.start()
        try:
            for _ in range(500):  # the SUB joins late: publish until a batch reaches it
                pub.publish([AllBlocksCleared()])
                await asyncio.sleep(0.01)
                if sub.status(URL).num_feed_restarts:
                    break
            await until(lambda: "restart 1" in caplog.text)
        finally:
            await sub.stop()
    record = next(r for r in caplog.records if "restart 1" in r.getMessage())
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert "Traceback" in caplog.text and "NoneType: None" not in caplog.text


def flood_batch(i: int, blocks: int) -> list[BlockStored]:
    """``blocks`` new blocks in one chain of its own (distinct tokens per batch)."""
    ids = [i * 1000 + k for k in range(blocks * BS)]
    hashes = token_block_hashes(ids, BS, ENGINE_SEED)
    return [BlockStored(hashes, None, ids, BS)]


async def test_the_exact_view_is_capped_under_a_flood(pub):
    cap = 64
    fleet = fleet_of(max_entries=cap)
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    await sub.start()
    sizes: list[int] = []
    try:
        await joined(pub, fleet)
        for i in range(40):  # 40 x 10 blocks: six times the cap
            pub.publish(flood_batch(i, 10))
            await asyncio.sleep(0)
            model = fleet.sync.model(URL)
            sizes.append(model.num_stored if model is not None else 0)
        await until(lambda: fleet.kv_next_seq(URL) == pub._seq)
        status = sub.status(URL)
        assert status.num_overflows >= 1 and status.mode == "approximate"
        assert max(sizes) <= cap
        assert fleet.index.num_entries <= cap
        fleet.check_invariants()
        a = tokens((7, 2))
        pub.publish([AllBlocksCleared(), stored(a)])  # a reset starts a new, small view
        await until(lambda: fleet.index.matched_blocks(URL, router_keys(a)) == 2)
        assert fleet.is_exact(URL)
    finally:
        await sub.stop()


async def test_a_large_batch_is_applied_in_slices_between_other_work(pub):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint}, slice_blocks=256)
    await sub.start()
    try:
        await joined(pub, fleet)
        ids = [k % 30_000 for k in range(4096 * BS)]  # one chain of 4,096 blocks
        hashes = token_block_hashes(ids, BS, ENGINE_SEED)
        parents = [None, *hashes[:2047]]
        small = [
            BlockStored([h], parents[i], ids[i * BS : (i + 1) * BS], BS)
            for i, h in enumerate(hashes[:2048])
        ]
        big = BlockStored(hashes[2048:], hashes[2047], ids[2048 * BS :], BS)
        seen: list[int] = []  # the view's size each time another coroutine runs

        async def other_work() -> None:
            for _ in range(100_000):  # bounded: stops once the batch is in
                seen.append(fleet.index.num_blocks(URL))
                if seen[-1] == len(hashes):
                    return
                await asyncio.sleep(0)

        worker = asyncio.create_task(other_work())
        pub.publish([*small, big])  # 2,048 one-block events, then one of 2,048 blocks
        await asyncio.wait_for(worker, 30)
        partial = sorted({n for n in seen if 0 < n < len(hashes)})
        assert len(partial) >= 4, "the batch went in without the loop running in between"
        assert partial == sorted(partial) and seen[-1] == len(hashes)  # in order, whole
        assert fleet.index.matched_blocks(URL, token_block_hashes(ids, BS)) == len(hashes)
        fleet.check_invariants()
    finally:
        await sub.stop()


async def test_messages_over_the_size_limit_are_refused_by_zmq(pub):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint}, max_message_bytes=64 * 1024)
    await sub.start()
    try:
        await joined(pub, fleet)
        seq = fleet.kv_next_seq(URL)
        ids = list(range(10_000 * BS))  # ~200 KB: over 64 KiB, within the decoder's limits
        pub.publish([BlockStored(token_block_hashes(ids, BS, ENGINE_SEED), None, ids, BS)])
        a = tokens((5, 1))
        for _ in range(500):  # ZMQ dropped the connection; wait until it is back
            pub.publish([stored(a)])
            await asyncio.sleep(0.01)
            if (fleet.kv_next_seq(URL) or 0) > seq + 1:
                break
        assert fleet.index.num_entries < 10_000  # the big batch never reached the router
        assert not fleet.is_exact(URL)  # it shows as a gap without replay
        status = sub.status(URL)
        assert status.running and status.num_malformed_batches == 0
        assert status.num_disconnects >= 1  # ZMQ dropped it; the feed connected again
    finally:
        await sub.stop()


def test_subscriber_settings_are_checked():
    with pytest.raises(ValueError):
        KvEventSubscriber(fleet_of(), {}, restart_backoff_s=(1.0, 0.5))
    with pytest.raises(ValueError):
        KvEventSubscriber(fleet_of(), {}, max_message_bytes=0)
