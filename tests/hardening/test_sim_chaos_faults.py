"""The simulator faults the chaos schedule adds: flapping health and unreliable KV streams."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvroute.common.kv_events import decode_batch
from kvroute.sim.faults import Faults, parse_fault_spec
from kvroute.sim.kv_publisher import garbage_message
from kvroute.sim.server import SimFleet, start_fleet
from tests.sim.helpers import long_prompt, post


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    f = await start_fleet(1, profile="tiny", speedup=8.0, kv_events=True, kv_replay=True)
    try:
        yield f
    finally:
        await f.close()


def test_flap_alternates_health_by_period():
    faults = Faults(flap_s=2.0)
    assert [faults.is_healthy(t) for t in (0.0, 1.9, 2.0, 3.9, 4.0)] == [
        True, True, False, False, True,
    ]  # fmt: skip
    faults.update({"flap": None, "unhealthy": True})
    assert not faults.is_healthy(0.0)
    faults.clear()
    assert faults == Faults()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0=flap:0.5", (0, {"flap": 0.5})),
        ("1=kv_gap:3", (1, {"kv_gap": 3})),
        ("all=kv_garbage:1", (None, {"kv_garbage": 1})),
    ],
)
def test_new_fault_specs_parse(spec, expected):
    assert parse_fault_spec(spec) == expected


@pytest.mark.parametrize(
    "changes", [{"flap": 0}, {"flap": float("inf")}, {"kv_gap": 0}, {"kv_garbage": 1.5}]
)
def test_bad_new_fault_values_are_refused(changes):
    with pytest.raises(ValueError):
        Faults().update(changes)


async def test_flapping_backend_answers_both_ways(fleet, session):
    url = fleet.urls[0]
    assert (await post(session, url + "/sim/faults", {"flap": 0.05}))[0] == 200
    seen: set[int] = set()
    for _ in range(200):  # bounded: 50 ms periods, so both answers come within a second
        async with session.get(url + "/health") as resp:
            seen.add(resp.status)
        if seen == {200, 503}:
            break
        await asyncio.sleep(0.01)
    assert seen == {200, 503}


@contextlib.asynccontextmanager
async def _subscriber(endpoint: str) -> AsyncIterator[zmq.asyncio.Socket]:
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


async def _messages_until(sock, session, url: str, done) -> list[list[bytes]]:
    """Send fresh prompts (each one a batch of events) until ``done(messages)`` holds."""
    got: list[list[bytes]] = []
    for i in range(100):
        await post(session, url + "/v1/completions", {"prompt": long_prompt(f"p{i}", 40),
                                                      "max_tokens": 1})  # fmt: skip
        while await sock.poll(50):
            got.append(await sock.recv_multipart())
        if done(got):
            return got
    raise AssertionError(f"condition not reached; {len(got)} messages")


async def test_kv_gap_loses_batches_for_good(fleet, session):
    url, backend = fleet.urls[0], fleet.backends[0]
    async with _subscriber(fleet.kv_endpoints[0]) as sock:
        await _messages_until(sock, session, url, bool)  # subscribed: the stream flows
        await post(session, url + "/sim/faults", {"kv_gap": 2})
        got = await _messages_until(sock, session, url, lambda m: len(m) >= 8)
    seqs = [int.from_bytes(m[1], "big") for m in got]
    assert any(b - a > 1 for a, b in itertools.pairwise(seqs)), seqs
    assert backend.publisher is not None and backend.publisher.num_lost >= 1
    buffered = {seq for seq, _ in backend.publisher._buffer}
    missing = set(range(min(seqs), max(seqs))) - set(seqs)
    assert missing and not missing & buffered  # no replay can fill these


async def test_kv_garbage_is_sent_between_real_batches(fleet, session):
    url, backend = fleet.urls[0], fleet.backends[0]
    async with _subscriber(fleet.kv_endpoints[0]) as sock:
        await _messages_until(sock, session, url, bool)
        await post(session, url + "/sim/faults", {"kv_garbage": 1})
        got = await _messages_until(sock, session, url, lambda m: len(m) >= 30)
    assert backend.publisher is not None and backend.publisher.num_garbage >= 10
    odd = [m for m in got if len(m) != 3 or len(m[1]) != 8]
    assert odd, "frame-level junk arrives too"


@pytest.mark.parametrize("i", range(10))
def test_every_garbage_shape_is_refused_by_the_decoder_as_bad_input(i):
    """A KV batch that is not one must be a ValueError, never another exception that
    would stop a subscriber (issue 9, finding 8)."""
    frames, numbered = garbage_message(i, b"kv-events", 7, 1.0)
    if not numbered:
        assert len(frames) != 3 or len(frames[1]) != 8
        return
    with pytest.raises(ValueError):
        decode_batch(frames[2])
