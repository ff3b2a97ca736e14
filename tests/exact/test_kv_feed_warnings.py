"""Review 2, finding 4: a backend that follows KV events but is approximate says so at
WARNING, once per episode, and why; over real ZMQ (a ``KvEventPublisher``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from kvroute.common.kv_events import AllBlocksCleared
from kvroute.router.kv_feed import APPROXIMATE_NOTE
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.sim.kv_publisher import KvEventPublisher
from tests.conftest import until
from tests.exact.helpers import stored, tokens
from tests.exact.test_harden_kv_feed import URL, fleet_of, joined

LOGGER = "kvroute.router.kv_subscriber"


@pytest.fixture
async def pub() -> AsyncIterator[KvEventPublisher]:
    p = KvEventPublisher("tcp://127.0.0.1:0")
    try:
        yield p
    finally:
        await p.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_router_started_after_its_engine_without_replay_says_why_once(pub, caplog):
    fleet = fleet_of()
    for i in range(3):  # the engine's history, before anyone subscribed
        pub.publish([stored(tokens((i, 2)))])
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    caplog.set_level(logging.INFO, logger=LOGGER)
    await sub.start()
    try:
        for i in range(500):  # the SUB joins late: publish until batches reach it
            pub.publish([stored(tokens((10 + i, 2)))])
            await asyncio.sleep(0.01)
            if sub._feeds[URL].num_received >= 3:
                break
        assert not fleet.is_exact(URL)
        (warning,) = warnings_of(caplog)  # one line, not one per batch
        assert "before the router subscribed" in warning and "kv_replay" in warning
        assert APPROXIMATE_NOTE in warning
        pub.publish([AllBlocksCleared()])  # the engine's next reset ends the episode
        await until(lambda: fleet.is_exact(URL))
        await until(lambda: "exact again" in caplog.text)
        pub._send(b"\x00garbage")  # a new episode: reported again
        await until(lambda: len(warnings_of(caplog)) == 2)
        assert "skipped" in warnings_of(caplog)[1] and APPROXIMATE_NOTE in warnings_of(caplog)[1]
        pub._send(b"\x00garbage")  # malformed batch 2: still logged (1, 2, 4, ...)
        pub._send(b"\x00garbage")  # 3: neither a new episode nor a power of two
        await until(lambda: sub.status(URL).num_malformed_batches == 3)
        assert len(warnings_of(caplog)) == 3
    finally:
        await sub.stop()


async def test_a_gap_that_cannot_be_filled_is_reported_once(pub, caplog):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    caplog.set_level(logging.INFO, logger=LOGGER)
    await sub.start()
    try:
        await joined(pub, fleet)  # may report batches sent before the SUB joined: healed
        caplog.clear()
        for _ in range(2):
            pub._seq += 1  # a batch lost on the way
            pub.publish([stored(tokens((5, 2)))])
        await until(lambda: fleet.kv_next_seq(URL) == pub._seq)
        (warning,) = warnings_of(caplog)
        assert "lost (no replay endpoint, kv_replay)" in warning and APPROXIMATE_NOTE in warning
        assert caplog.text.count(" lost ") == 2  # the second at INFO
    finally:
        await sub.stop()


async def test_a_feed_that_receives_nothing_says_so(tmp_path, caplog):
    fleet = fleet_of()
    endpoint = f"ipc://{tmp_path}/nobody-publishes-here"
    sub = KvEventSubscriber(fleet, {URL: endpoint}, sync_grace_s=0.05)
    caplog.set_level(logging.INFO, logger=LOGGER)
    await sub.start()
    try:
        await until(lambda: bool(warnings_of(caplog)))
        (warning,) = warnings_of(caplog)
        assert f"nothing received from {endpoint}" in warning and APPROXIMATE_NOTE in warning
    finally:
        await sub.stop()


async def test_badly_framed_messages_are_counted_and_logged_rate_limited(pub, caplog):
    fleet = fleet_of()
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint})
    await sub.start()
    try:
        await joined(pub, fleet)
        caplog.set_level(logging.WARNING, logger=LOGGER)
        caplog.clear()
        bad = [
            [b"only one frame"],
            [b"kv", b"\x00\x01"],
            [b"kv", b"", b"x"],
            [b"kv", b"s" * 4, b"x"],
        ]
        for frames in bad:  # 1, 2 or 4 frames, an empty or a 4-byte seq
            pub._send_frames(frames)
        await until(lambda: sub.status(URL).num_bad_messages == 4)
        lines = warnings_of(caplog)
        assert len(lines) == 3  # the 1st, 2nd and 4th
        assert "1 frames of 14 bytes" in lines[0] and "8-byte seq" in lines[0]
        assert "(4 so far)" in lines[2]
        assert fleet.is_exact(URL)  # nothing applied, nothing lost
    finally:
        await sub.stop()
