"""A late router whose replay comes in pieces: cut short, or with batches lost in transit.

vLLM serves replays from a ROUTER socket, which drops what passes its send high-water
mark (1,000 messages) when the reader is slower than the sender: a long history arrives
cut short, without its end marker. On the real-vLLM run of issue 10, by the fourth
repetition the history held ~10k batches and a fresh exact router kept the view of an
old point of it: its first decisions were hits on prompts the engine no longer held,
and it put four of six prompts on one engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import zmq
import zmq.asyncio

from kvroute.common.kv_events import AllBlocksCleared
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.sim.kv_publisher import END_SEQ, KvEventPublisher
from tests.conftest import until
from tests.exact.helpers import BS, router_keys, stored, tokens

CUT = 400  # batches one replay answer carries before the rest is dropped


async def serve_cut_replays(sock: zmq.asyncio.Socket, pub: KvEventPublisher) -> None:
    """Answer each replay request with at most CUT batches, and the end marker only when
    nothing was left out (what a ROUTER past its high-water mark delivers)."""
    while True:
        client, _, start = await sock.recv_multipart()
        due = [(s, p) for s, p in pub._buffer if s >= int.from_bytes(start, "big")]
        for seq, payload in due[:CUT]:
            await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        if len(due) <= CUT:
            await sock.send_multipart((client, b"", END_SEQ, b""))


URL = "http://engine:8000"


@contextlib.asynccontextmanager
async def replaying(
    pub: KvEventPublisher, serve: Callable[[zmq.asyncio.Socket], Awaitable[None]]
) -> AsyncIterator[tuple[Fleet, KvEventSubscriber]]:
    """An exact fleet of one engine whose replays ``serve`` answers from our own ROUTER
    (standing in for vLLM's), its subscriber started; everything closed on the way out."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    server = asyncio.get_running_loop().create_task(serve(router))
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=BS, mode="exact"))
    fleet.add_backend(URL)
    sub = KvEventSubscriber(fleet, {URL: pub.endpoint}, {URL: replay}, replay_timeout_s=0.5)
    await sub.start()
    try:
        yield fleet, sub
    finally:
        await sub.stop()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        router.close()
        ctx.term()
        await pub.close()


async def test_a_replay_cut_short_is_resumed_until_the_engines_state():
    # The publisher buffers for replay; our ROUTER serves the buffer cut short.
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    old, new = tokens((1, 3)), tokens((2, 3))
    for i in range(3 * CUT):  # earlier runs: prompts stored, caches reset
        pub.publish([stored(old) if i % 2 == 0 else AllBlocksCleared()])
    pub.publish([stored(old)])
    pub.publish([AllBlocksCleared()])  # the reset before this router started
    pub.publish([stored(new)])
    last = pub._seq - 1
    async with replaying(pub, lambda sock: serve_cut_replays(sock, pub)) as (fleet, sub):
        await until(lambda: (sub.status(URL).last_seq or -1) == last, timeout_s=20.0)
        assert fleet.is_exact(URL)
        assert fleet.index.matched_blocks(URL, router_keys(old)) == 0  # cleared since
        assert fleet.index.matched_blocks(URL, router_keys(new)) == 3
        fleet.check_invariants()


async def serve_lossy_replays(sock: zmq.asyncio.Socket, pub: KvEventPublisher, lose: set[int]):
    """Answer each replay request in full, except that each batch in ``lose`` is lost in
    transit the first time it is due (a ROUTER past its high-water mark drops a message
    and sends the next ones once its queue drains)."""
    while True:
        client, _, start = await sock.recv_multipart()
        for seq, payload in list(pub._buffer):
            if seq < int.from_bytes(start, "big"):
                continue
            if seq in lose:
                lose.discard(seq)
                continue
            await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        await sock.send_multipart((client, b"", END_SEQ, b""))


async def test_a_batch_lost_inside_a_replay_is_asked_for_again():
    # The lost batch is the reset before this router started: taken as a gap for good,
    # the view fell back to the blocks before it (the previous run's prompts) and kept
    # them until the next reset, the first requests were 'prefix' on the wrong engine.
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    old, new = tokens((1, 3)), tokens((2, 3))
    for i in range(20):
        pub.publish([stored(old) if i % 2 == 0 else AllBlocksCleared()])
    pub.publish([stored(old)])
    reset = pub._seq
    pub.publish([AllBlocksCleared()])
    pub.publish([stored(new)])
    last = pub._seq - 1
    lossy = lambda sock: serve_lossy_replays(sock, pub, {reset})  # noqa: E731
    async with replaying(pub, lossy) as (fleet, sub):
        await until(lambda: (sub.status(URL).last_seq or -1) == last)
        assert fleet.is_exact(URL) and sub.status(URL).num_gaps == 0
        assert fleet.index.matched_blocks(URL, router_keys(old)) == 0
        assert fleet.index.matched_blocks(URL, router_keys(new)) == 3


# -- the view a replay rebuilds stays out of routing until it reaches the present ------


def _history(fleet: Fleet, url: str, batches: list[list]) -> None:
    for seq, events in enumerate(batches):
        fleet.apply_kv_batch(url, seq, float(seq), events, 0.0)


def test_a_view_rebuilt_by_replay_is_used_only_once_it_reaches_the_present():
    url = "http://engine:8000"
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=BS, mode="exact"))
    fleet.add_backend(url)
    old, new = tokens((1, 3)), tokens((2, 3))
    fleet.kv_catch_up_begin(url)
    _history(fleet, url, [[stored(old)]])  # an earlier run's prompt, evicted since
    fleet.update_engine_stats(url, num_gpu_blocks=64)  # scraped meanwhile
    assert not fleet.is_exact(url)
    assert fleet.index.matched_blocks(url, router_keys(old)) == 0  # not routed on
    fleet.apply_kv_batch(url, 1, 1.0, [AllBlocksCleared()], 0.0)
    fleet.apply_kv_batch(url, 2, 2.0, [stored(new)], 0.0)
    fleet.check_invariants()
    fleet.kv_catch_up_end(url, complete=True)
    assert fleet.is_exact(url)
    assert fleet.backend_states()[0].capacity_blocks == 64  # not the size before the scrape
    assert fleet.index.matched_blocks(url, router_keys(old)) == 0
    assert fleet.index.matched_blocks(url, router_keys(new)) == 3
    fleet.check_invariants()


def test_a_replay_that_stops_short_leaves_the_backend_approximate_until_a_reset():
    url = "http://engine:8000"
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=BS, mode="exact"))
    fleet.add_backend(url)
    old, new = tokens((1, 3)), tokens((2, 3))
    fleet.kv_catch_up_begin(url)
    _history(fleet, url, [[stored(old)]])
    fleet.kv_catch_up_end(url, complete=False)  # the engine stopped answering
    assert not fleet.is_exact(url)
    assert fleet.index.matched_blocks(url, router_keys(old)) == 0  # the past is not used
    fleet.apply_kv_batch(url, 1, 1.0, [AllBlocksCleared(), stored(new)], 0.0)
    assert fleet.is_exact(url)
    assert fleet.index.matched_blocks(url, router_keys(new)) == 3
    fleet.check_invariants()
