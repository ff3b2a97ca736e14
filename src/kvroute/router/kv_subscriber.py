"""KV-cache event subscriber: one ZMQ SUB per backend feeding ``Fleet.apply_kv_batch``.

Each backend's engine publishes ``[topic, 8-byte big-endian seq, msgpack batch]`` on a
PUB socket (vLLM's ``ZmqEventPublisher``; our simulator's ``KvEventPublisher``). One task
per backend receives, decodes (``engine.kv_events.decode_batch``: array or map events,
int or 32-byte hashes) and hands each batch to the pure core, which checks sequence
numbers and keeps the exact view (core/kv_sync.py).

Gaps: when the core reports one and the backend has a replay endpoint (vLLM's
``replay_endpoint``, a ROUTER), a DEALER asks for every buffered batch from the missing
number: it sends ``[b"", start_seq (8 bytes big-endian)]`` and reads ``[b"", seq,
payload]`` frames until ``seq == -1``. If the replay cannot fill the gap (no endpoint,
no answer, or the buffer no longer reaches back), the core falls back to the
approximate model for that backend until the engine's next ``AllBlocksCleared``. At
start, a backend with a replay endpoint is synced from seq 0 the same way, so a router
that starts after its engines does not wait for a reset.

The request path never waits on events: receiving is ``zmq.asyncio``, each batch is
applied in one short synchronous call and the task yields to the loop after each one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvroute.core.fleet import Fleet
from kvroute.core.kv_sync import KvOutcome
from kvroute.engine.kv_events import decode_batch

log = logging.getLogger(__name__)

END_SEQ = -1  # a replay's last frame carries this (8 bytes, signed)


@dataclass(frozen=True, slots=True)
class KvSubscriberStatus:
    """One backend's event feed, for metrics and the status page."""

    url: str  # backend URL
    endpoint: str  # PUB endpoint subscribed to
    replay_endpoint: str | None  # ROUTER endpoint for replays (None: no replay)
    running: bool  # its receive task is alive
    mode: str  # "exact" (view from events) or "approximate" (fallback)
    last_seq: int | None  # last applied batch number
    lag_s: float | None  # wall-clock receive time - engine timestamp of that batch
    num_gaps: int  # sequence gaps found
    num_events: int  # events applied
    num_replays: int  # replay requests sent
    num_bad_messages: int  # messages that were not KV event batches


class _Feed:
    """One backend's subscription (internal)."""

    def __init__(self, url: str, endpoint: str, replay_endpoint: str | None) -> None:
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.task: asyncio.Task[None] | None = None
        self.num_replays = 0
        self.num_bad = 0


class KvEventSubscriber:
    """Follows every backend's KV events into ``fleet`` (module doc).

    ``backends`` maps backend URL -> PUB endpoint, ``replay`` URL -> replay endpoint.
    ``clock`` is the fleet's clock (its ``now``); ``wall`` measures lag against the
    engine's timestamps (the engines' wall clocks).
    """

    def __init__(
        self,
        fleet: Fleet,
        backends: Mapping[str, str] | None = None,
        replay: Mapping[str, str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self._clock = clock
        self._wall = wall
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._feeds: dict[str, _Feed] = {}
        for url, endpoint in (backends or {}).items():
            self._feeds[url] = _Feed(url, endpoint, (replay or {}).get(url))

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open one SUB per backend (needs a running loop); idempotent."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for feed in self._feeds.values():
            self._launch(feed)

    async def stop(self) -> None:
        """Cancel every feed and close the sockets."""
        feeds = list(self._feeds.values())
        for feed in feeds:
            await self._cancel(feed)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def add_backend(self, url: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Follow ``url``'s events (starts now if the subscriber runs); replaces an old feed."""
        old = self._feeds.pop(url, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        feed = _Feed(url, endpoint, replay_endpoint)
        self._feeds[url] = feed
        if self._ctx is not None:
            self._launch(feed)

    def remove_backend(self, url: str) -> None:
        """Stop following ``url`` (unknown: no-op). Remove it from the fleet separately."""
        feed = self._feeds.pop(url, None)
        if feed is not None and feed.task is not None:
            feed.task.cancel()

    def status(self, url: str) -> KvSubscriberStatus | None:
        feed = self._feeds.get(url)
        stream = self.fleet.sync.url_to_stream.get(url)
        if feed is None:
            return None
        return KvSubscriberStatus(
            url=url,
            endpoint=feed.endpoint,
            replay_endpoint=feed.replay_endpoint,
            running=feed.task is not None and not feed.task.done(),
            mode="exact" if self.fleet.is_exact(url) else "approximate",
            last_seq=stream.last_seq if stream is not None and stream.last_seq >= 0 else None,
            lag_s=stream.lag_s if stream is not None else None,
            num_gaps=stream.num_gaps if stream is not None else 0,
            num_events=stream.num_events if stream is not None else 0,
            num_replays=feed.num_replays,
            num_bad_messages=feed.num_bad,
        )

    def urls(self) -> list[str]:
        return sorted(self._feeds)

    def _launch(self, feed: _Feed) -> None:
        if feed.task is None or feed.task.done():
            name = f"kv-events-{feed.url}"
            feed.task = asyncio.get_running_loop().create_task(self._follow(feed), name=name)

    @staticmethod
    async def _cancel(feed: _Feed) -> None:
        if feed.task is not None:
            feed.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed.task
            feed.task = None

    # -- receiving -------------------------------------------------------------------------

    async def _follow(self, feed: _Feed) -> None:
        assert self._ctx is not None, "feeds run only while the subscriber is started"
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(feed.endpoint)
        try:
            if feed.replay_endpoint is not None:
                await self._initial_sync(feed)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    feed.num_bad += 1
                    continue
                await self._handle(feed, int.from_bytes(frames[1], "big"), frames[2])
                await asyncio.sleep(0)  # a burst of queued batches must not hog the loop
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not kill routing; the backend goes approximate
            log.exception("KV event feed of %s stopped", feed.url)
            next_seq = self.fleet.kv_next_seq(feed.url)
            if next_seq is not None:  # no more events will come: stop trusting the view
                self.fleet.kv_gap_unfilled(feed.url, next_seq + 1)
            # logged; the task ends (status: not running) and stop() has nothing to raise
        finally:
            sock.close(linger=0)

    async def _initial_sync(self, feed: _Feed) -> None:
        """Replay from 0: the engine's whole history, or proof that it has none."""
        if self.fleet.kv_next_seq(feed.url) != 0:
            return
        received = await self._replay(feed, 0)
        if received == 0 and self.fleet.kv_next_seq(feed.url) == 0:
            self.fleet.kv_history_empty(feed.url)

    async def _handle(self, feed: _Feed, seq: int, payload: bytes) -> None:
        outcome = self._apply(feed, seq, payload)
        if outcome is not KvOutcome.GAP:
            return
        start = self.fleet.kv_next_seq(feed.url)
        if feed.replay_endpoint is not None and start is not None:
            await self._replay(feed, start)
            outcome = self._apply(feed, seq, payload)
        if outcome is KvOutcome.GAP:
            self.fleet.kv_gap_unfilled(feed.url, seq)
            self._apply(feed, seq, payload)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> KvOutcome | None:
        try:
            ts, events = decode_batch(payload)
        except ValueError:
            feed.num_bad += 1
            return None
        now = self._clock()
        lag_s = max(0.0, self._wall() - ts)
        return self.fleet.apply_kv_batch(feed.url, seq, ts, events, now, lag_s=lag_s)

    async def _replay(self, feed: _Feed, start: int) -> int:
        """Ask the engine for batches ``>= start`` and apply them; returns how many came.

        A buffer that no longer reaches back to ``start`` leaves a gap: the backend goes
        approximate and the stream continues from the first batch the buffer still has.
        """
        assert self._ctx is not None and feed.replay_endpoint is not None
        feed.num_replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(feed.replay_endpoint)
        received = 0
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self._replay_timeout_s)
                if len(frames) < 2 or len(frames[-2]) != 8:
                    feed.num_bad += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    break
                received += 1
                if self._apply(feed, seq, frames[-1]) is KvOutcome.GAP:
                    self.fleet.kv_gap_unfilled(feed.url, seq)
                    self._apply(feed, seq, frames[-1])
                await asyncio.sleep(0)
        except asyncio.TimeoutError:
            log.warning("KV event replay from %s timed out", feed.replay_endpoint)
        finally:
            sock.close(linger=0)
        return received
