"""Issue 9, "also deliver": fuzzing the KV event decoder and apply path over real ZMQ.

Random bytes, msgpack of the wrong shape (wrong types, huge ints, NaN, nested lists) and
plausible events with hostile values go out as numbered batches from a real publisher to
a running subscriber. After each example: the feed task never failed, the fleet's
invariants hold, and the exact views stay within their cap.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, encode_batch
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.sim.kv_publisher import KvEventPublisher
from tests.exact.test_harden_kv_feed import URL, fleet_of, joined

CAP = 300  # the index's max_entries: the exact view's cap
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
FIELDS += ["medium", "lora_name", "extra_keys", "group_idx"]

scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=40)
)
wire = st.recursive(
    scalar,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
tag = st.sampled_from(TAGS) | wire
hash_value = st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32) | wire
wrong_event = st.tuples(tag, st.lists(wire, max_size=9)).map(lambda t: [t[0], *t[1]]) | (
    st.dictionaries(st.sampled_from(FIELDS), wire, max_size=9).flatmap(
        lambda d: tag.map(lambda t: {**d, "type": t})
    )
)


@st.composite
def plausible_event(draw: st.DrawFn) -> Any:
    """Right types, hostile values: unknown parents, odd sizes, huge or negative ids."""
    kind = draw(st.sampled_from(TAGS))
    if kind == "AllBlocksCleared":
        return [kind]
    hashes = draw(st.lists(st.integers(0, 50) | hash_value, max_size=8))
    medium = draw(st.sampled_from(["GPU", "CPU", None]))
    if kind == "BlockRemoved":
        return [kind, hashes, medium]
    block_size = draw(st.integers(1, 4) | st.integers(-5, 2**64 - 1))
    n = max(0, len(hashes) * min(block_size, 4) - draw(st.integers(0, 3)))
    token_ids = draw(
        st.lists(st.integers(0, 9) | st.integers(-(2**63), 2**64 - 1), min_size=n, max_size=n)
    )
    parent = draw(st.none() | st.integers(0, 50) | hash_value)
    lora_name = draw(st.none() | st.text(max_size=5))
    extra = draw(st.none() | st.lists(st.none() | st.lists(wire, max_size=3), max_size=4))
    return [kind, hashes, parent, token_ids, block_size, None, medium, lora_name, extra]


@st.composite
def flood(draw: st.DrawFn) -> bytes:
    """A valid batch storing one chain of 100..250 new blocks, after a reset or not: two
    in one example pass the cap of 300 blocks."""
    n = draw(st.integers(100, 250))
    base = draw(st.integers(0, 10**6))
    ids = [base + k for k in range(n * 4)]
    hashes = token_block_hashes(ids, 4, base)
    reset = [["AllBlocksCleared"]] if draw(st.booleans()) else []
    return msgspec.msgpack.encode([time.time(), [*reset, ["BlockStored", hashes, None, ids, 4]]])


def batch_of(ts: Any, events: list[Any]) -> bytes:
    return msgspec.msgpack.encode([ts, events])


payloads = st.lists(
    st.binary(max_size=200)
    | wire.map(msgspec.msgpack.encode)
    | st.builds(batch_of, st.floats() | scalar, st.lists(wrong_event, max_size=4))
    | st.builds(batch_of, st.floats(0, 2e9), st.lists(plausible_event(), max_size=6))
    | flood(),
    min_size=1,
    max_size=8,
)


def test_fuzzed_batches_never_break_the_feed_nor_pass_the_caps():
    loop = asyncio.new_event_loop()
    fleet = fleet_of(max_entries=CAP)
    pub = KvEventPublisher("tcp://127.0.0.1:0")
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    max_stored = 0

    async def send(batch: list[bytes]) -> None:
        nonlocal max_stored
        pub.publish([AllBlocksCleared()])  # each example starts from an exact, empty view
        for payload in batch:
            pub._send(payload)
        pub._send(encode_batch(time.time(), []))  # then an empty batch marks the end
        for _ in range(2000):  # wait until the subscriber has handled everything
            model = fleet.sync.model(URL)
            max_stored = max(max_stored, model.num_stored if model is not None else 0)
            if fleet.kv_next_seq(URL) == pub._seq:
                break
            await asyncio.sleep(0.005)
        assert fleet.kv_next_seq(URL) == pub._seq, "the feed stopped handling batches"

    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(payloads)
    def fuzz(batch: list[bytes]) -> None:
        loop.run_until_complete(send(batch))
        status = sub.status(URL)
        assert status is not None and status.running and status.num_feed_restarts == 0
        fleet.check_invariants()  # includes: exact views within the index's cap
        assert fleet.index.num_entries <= CAP

    try:
        loop.run_until_complete(sub.start())
        loop.run_until_complete(joined(pub, fleet))
        fuzz()
        status = sub.status(URL)
        # malformed batches are always drawn; whether a flood passes the cap depends on the
        # draw (about 1 run in 8 it does not), and the cap has its deterministic test in
        # test_harden_kv_feed.py, so only the invariants above are required of it here
        assert status.num_malformed_batches > 0
        assert max_stored <= CAP
    finally:
        loop.run_until_complete(sub.stop())
        loop.run_until_complete(pub.close())
        loop.close()
