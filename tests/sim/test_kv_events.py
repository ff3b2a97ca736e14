"""KV events over ZMQ, decoded by a plain SUB subscriber as a router would."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq
import zmq.asyncio

from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvroute.common.tokenizer import default_tokenizer
from tests.sim.helpers import long_prompt, post

_fresh = itertools.count()


@pytest.fixture
async def sub(fleet):
    """A SUB socket on backend 0's publisher, known to be receiving (slow-joiner safe)."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sock.connect(fleet.kv_endpoints[0])
    try:
        yield sock
    finally:
        sock.close()


async def _receive(sock: zmq.asyncio.Socket, timeout_s: float = 2.0) -> list:
    """Every (seq, event) received until the socket is quiet for ``timeout_s``/10."""
    got = []
    while await sock.poll(int(timeout_s * 100 if got else timeout_s * 1000)):
        topic, seq, payload = await sock.recv_multipart()
        assert topic == b"kv-events" and len(seq) == 8
        _, events = decode_batch(payload)
        got.extend((int.from_bytes(seq, "big"), e) for e in events)
    return got


async def _warm_up(session, url: str, sock: zmq.asyncio.Socket) -> list:
    """Send fresh prompts until the subscription is live; returns the (seq, event)s seen."""
    for _ in range(50):
        await post(
            session, url, {"prompt": long_prompt(f"warm{next(_fresh)}", 40), "max_tokens": 1}
        )
        got = await _receive(sock, 0.2)
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError("no KV events arrived")


async def test_new_prompt_is_announced_as_block_stored(fleet, session, sub):
    url = fleet.urls[0] + "/v1/completions"
    last_seq = (await _warm_up(session, url, sub))[-1][0]
    prompt = long_prompt("stored", 200)
    ids = default_tokenizer().encode(prompt)
    await post(session, url, {"prompt": prompt, "max_tokens": 1})
    got = await _receive(sub)
    assert next(s for s, _ in got) == last_seq + 1  # sequence numbers continue
    stored = [e for _, e in got if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].block_size == 16
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens[: len(ids) // 16 * 16] == ids[: len(ids) // 16 * 16]
    assert sum(len(e.block_hashes) for e in stored) >= len(ids) // 16
    for parent, child in itertools.pairwise(stored):
        assert child.parent_block_hash == parent.block_hashes[-1]


async def test_eviction_is_announced_as_block_removed(fleet, session, sub):
    url = fleet.urls[0] + "/v1/completions"
    await _warm_up(session, url, sub)
    stored: set[int] = set()
    removed: set[int] = set()
    # tiny holds 512 blocks; seven ~100-block prompts must evict the first ones
    for i in range(7):
        await post(session, url, {"prompt": long_prompt(f"evict{i}", 800), "max_tokens": 1})
        for _, e in await _receive(sub, 0.5):
            if isinstance(e, BlockStored):
                stored.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert not removed & set(e.block_hashes), "a block is removed once"
                removed.update(e.block_hashes)
    # (warm-up blocks stored before the subscription was live may be removed too)
    assert removed & stored, "a full cache must evict blocks it announced"


async def test_reset_announces_all_blocks_cleared(fleet, session, sub):
    await _warm_up(session, fleet.urls[0] + "/v1/completions", sub)
    async with session.post(fleet.urls[0] + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    assert any(isinstance(e, AllBlocksCleared) for _, e in await _receive(sub))


async def test_replay_socket_resends_buffered_batches(session):
    from kvroute.sim.server import start_fleet

    fleet = await start_fleet(1, profile="tiny", kv_events=True, kv_replay=True)
    try:
        await post(session, fleet.urls[0] + "/v1/completions", {"prompt": "replay me " * 40})
        replay = fleet.backends[0].publisher.replay_endpoint
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay)
        try:
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = []
            while True:
                assert await sock.poll(2000)
                _, seq, payload = await sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                frames.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
        finally:
            sock.close()
        assert frames and frames[0][0] == 0
        assert any(isinstance(e, BlockStored) for _, events in frames for e in events)
    finally:
        await fleet.close()
