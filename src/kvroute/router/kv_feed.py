"""One backend's KV event feed: receive, decode, apply, and replay what went missing.

The KV subscriber (router/kv_subscriber.py) keeps the feeds and restarts a failed one;
this is what one run of a feed does, as a mixin of ``KvEventSubscriber``.

Each backend's engine publishes ``[topic, 8-byte big-endian seq, msgpack batch]`` on a
PUB socket (vLLM's ``ZmqEventPublisher``; our simulator's ``KvEventPublisher``). A run
receives on a SUB, decodes (``common.kv_events.decode_batch``: array or map events, int
or 32-byte hashes) and hands each batch to the pure core, which checks sequence numbers
and keeps the exact view (core/kv_sync.py).

Gaps: when the core reports one and the backend has a replay endpoint (vLLM's
``replay_endpoint``, a ROUTER), a DEALER asks for every buffered batch from the missing
number: it sends ``[b"", start_seq (8 bytes big-endian)]`` and reads ``[b"", seq,
payload]`` frames until ``seq == -1``. If the replay cannot fill the gap (no endpoint,
no answer, or the buffer no longer reaches back), the core falls back to the
approximate model for that backend until the engine's next ``AllBlocksCleared``. At
start, a backend with a replay endpoint is synced from seq 0 the same way, so a router
that starts after its engines does not wait for a reset. An answer can stop short,
without its end marker: vLLM's ROUTER drops what passes its send high-water mark (1,000
messages) when the reader is slower than the sender, so a long history comes in pieces.
The same drop can lose batches inside an answer. What came is still the history in
order: the feed asks again from where it stopped, or from the first batch lost after
the answer's first, as long as each answer brings more (before, it kept the view of an
old point of the history, or took a lost batch as a gap for good and fell back to the
blocks before it: on a real engine, the previous run's prompts, until the next reset).
Only an answer whose first batch is past the one asked for is a real gap: the buffer no
longer reaches back.

The request path never waits on events: receiving is ``zmq.asyncio``; a batch is decoded
a slice of events at a time and applied in parts of at most ``slice_blocks`` blocks
(``ExactSync.expect_parts``), yielding to the loop between slices; a block counts as
its tokens over 16 where it holds more (``event_work``), so an engine with 65,536-token
blocks cannot hold the loop for a second with one batch.

Hostile or broken input: a message larger than ``max_message_bytes`` is refused by ZMQ
(``ZMQ_MAXMSGSIZE``: the connection drops, the feed connects again, and the lost batches
show as a gap); a batch that fails to decode (``KvEventLimits``) or to apply is skipped
and counted (``num_malformed_batches``), and since the view now misses it, the backend
goes approximate as after an unfilled gap.

A backend that follows events but is approximate is reported at WARNING, once per
episode (until it is exact again), with the reason: it published before the router
subscribed and has no replay endpoint (its history cannot be had: add ``kv_replay``, or
reset the engine's prefix cache), batches were lost, a batch was malformed, or nothing
came within ``sync_grace_s`` of subscribing (a wrong endpoint, an unreachable host, an
engine not started or not publishing). Exact mode would otherwise stay off in silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvroute.common.kv_events import BatchReader, KvEvent, KvEventLimits, split_events
from kvroute.core.fleet import Fleet
from kvroute.core.kv_sync import KvOutcome

# the subscriber's logger: one name for everything the KV event feeds log
log = logging.getLogger("kvroute.router.kv_subscriber")

END_SEQ = -1  # a replay's last frame carries this (8 bytes, signed)
REPLAY_IDLE_S = 0.25  # silence mid-replay that means the answer was cut short
SYNC_GRACE_S = 30.0  # a run still approximate this long after subscribing says why
APPROXIMATE_NOTE = "the backend is approximate until the engine's next cache reset"


class Feed:
    """One backend's subscription: its endpoints, its running task and its counters."""

    def __init__(self, url: str, endpoint: str, replay_endpoint: str | None) -> None:
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.task: asyncio.Task[None] | None = None
        self.sock: zmq.asyncio.Socket | None = None  # the SUB of the current run
        self.num_replays = 0
        self.num_bad = 0
        self.num_malformed = 0
        self.num_restarts = 0
        self.num_received = 0  # framed messages received (all runs)
        self.num_disconnects = 0  # connections to the publisher lost (and made again)
        self.warned = False  # its being approximate was reported (until exact again)


class KvFeedMixin:
    """KvEventSubscriber mixin: one run of one feed (module doc). ``KvEventSubscriber``'s
    ``__init__`` sets these, and ``start`` the ZMQ context."""

    fleet: Fleet
    _clock: Callable[[], float]
    _wall: Callable[[], float]
    _topic: bytes
    _replay_timeout_s: float
    _limits: KvEventLimits
    _max_message_bytes: int
    _rcv_hwm: int
    _slice_blocks: int
    _sync_grace_s: float
    _ctx: zmq.asyncio.Context | None

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None, "feeds run only while the subscriber is started"
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        return sock

    async def _follow(self, feed: Feed) -> None:
        """One run: subscribe, sync from 0 when the backend can replay, then apply each
        batch as it comes; returns only by raising (a socket error, a cancel)."""
        sock = self._socket(zmq.SUB)
        watcher: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        checker = loop.create_task(self._check_synced(feed, self._sync_grace_s))
        try:
            sock.setsockopt(zmq.RCVHWM, self._rcv_hwm)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            watcher = loop.create_task(self._reconnect(feed, sock, monitor))
            sock.connect(feed.endpoint)
            feed.sock = sock
            if feed.replay_endpoint is not None:
                await self._initial_sync(feed)
                self._note_exact(feed)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._bad_message(feed, frames, "[topic, 8-byte seq, payload]")
                    continue
                feed.num_received += 1
                await self._handle(feed, int.from_bytes(frames[1], "big"), frames[2])
                self._note_exact(feed)
                await asyncio.sleep(0)  # a burst of queued batches must not hog the loop
        finally:
            feed.sock = None
            for task in (watcher, checker):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            sock.close(linger=0)

    async def _check_synced(self, feed: Feed, grace_s: float) -> None:
        """``grace_s`` into a run, report a backend still approximate (module doc)."""
        await asyncio.sleep(grace_s)
        if feed.num_received == 0:
            why = (
                f"nothing received from {feed.endpoint} in {grace_s:.3g} s (is it the "
                "engine's KV event endpoint, reachable, and the engine publishing there?)"
            )
        elif feed.replay_endpoint is not None:
            why = f"its history could not be replayed from {feed.replay_endpoint}"
        else:
            why = "no batch 0 and no cache reset seen since subscribing: its history is unknown"
        self._warn_approximate(feed, why)

    def _warn_approximate(self, feed: Feed, why: str) -> None:
        """WARNING, once per episode, that ``feed``'s backend is approximate, and why."""
        if feed.warned or self.fleet.is_exact(feed.url) or self.fleet.kv_next_seq(feed.url) is None:
            return
        feed.warned = True
        log.warning("KV events of %s: %s; %s", feed.url, why, APPROXIMATE_NOTE)

    def _note_exact(self, feed: Feed) -> None:
        """The episode a warning reported is over once the backend is exact again."""
        if feed.warned and self.fleet.is_exact(feed.url):
            feed.warned = False
            log.info("KV events of %s: the backend is exact again", feed.url)

    @staticmethod
    async def _reconnect(feed: Feed, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Connect again after each disconnect. ZMQ reconnects by itself after a network
        error but not after a protocol error, such as a message over ZMQ_MAXMSGSIZE: without
        this, one oversized batch would silence the feed for good."""
        try:
            while True:
                await monitor.recv_multipart()  # EVENT_DISCONNECTED (or the monitor's end)
                if sock.closed:
                    return  # the run is over; its successor has its own socket
                feed.num_disconnects += 1
                log.info("KV event feed of %s disconnected; connecting again", feed.url)
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(feed.endpoint)
                sock.connect(feed.endpoint)
        except zmq.ZMQError as exc:  # the socket went away meanwhile: the run fails anyway
            log.debug("KV event feed of %s: reconnect watcher ends: %s", feed.url, exc)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)

    async def _initial_sync(self, feed: Feed) -> None:
        """Replay from 0: the engine's whole history, or proof that it has none. The view
        it builds is used only once the replay has reached the present."""
        if self.fleet.kv_next_seq(feed.url) != 0:
            return
        self.fleet.kv_catch_up_begin(feed.url)
        complete = False
        try:
            received, complete = await self._replay(feed, 0)
        finally:
            self.fleet.kv_catch_up_end(feed.url, complete)
        if complete and received == 0 and self.fleet.kv_next_seq(feed.url) == 0:
            self.fleet.kv_history_empty(feed.url)  # an answer, and nothing in it

    async def _handle(self, feed: Feed, seq: int, payload: bytes, *, replay: bool = True) -> None:
        """Decode and apply one batch; on a gap, replay first (``replay``) or give up on
        the missing batches. A malformed batch is skipped and counted."""
        decoded = await self._decode(feed, seq, payload)
        if decoded is None:
            return
        ts, parts = decoded
        outcome = self._apply(feed, seq, ts, parts[0], len(parts))
        if outcome is KvOutcome.GAP and replay and feed.replay_endpoint is not None:
            start = self.fleet.kv_next_seq(feed.url)
            if start is not None:
                await self._replay(feed, start)
                outcome = self._apply(feed, seq, ts, parts[0], len(parts))
        if outcome is KvOutcome.GAP:
            first = self.fleet.kv_next_seq(feed.url)
            if first == 0 and feed.replay_endpoint is None:
                why = (
                    f"it published batches 0..{seq - 1} before the router subscribed, and "
                    "without a replay endpoint (kv_replay) that history cannot be had: add "
                    "kv_replay, or reset the engine's prefix cache (or restart the engine)"
                )
            elif feed.replay_endpoint is None:
                why = f"batches {first}..{seq - 1} lost (no replay endpoint, kv_replay)"
            else:
                why = f"batches {first}..{seq - 1} lost and not to be had by a replay"
            was_warned = feed.warned
            self.fleet.kv_gap_unfilled(feed.url, seq)
            self._warn_approximate(feed, why)
            if was_warned or not feed.warned:  # already reported: no new episode
                log.info("KV events of %s: %s; %s", feed.url, why, APPROXIMATE_NOTE)
            outcome = self._apply(feed, seq, ts, parts[0], len(parts))
        for part in parts[1:]:
            if outcome is not KvOutcome.APPLIED:
                return  # a duplicate, a removed backend, or a failure (already counted)
            await asyncio.sleep(0)
            outcome = self._apply(feed, seq, ts, part)

    async def _decode(
        self, feed: Feed, seq: int, payload: bytes
    ) -> tuple[float, list[list[KvEvent]]] | None:
        """Timestamp and events in parts of at most ``slice_blocks`` blocks; None when the
        payload is not a batch within the limits (counted, view dropped)."""
        try:
            reader = BatchReader(payload, self._limits)
            events = reader.read(self._slice_blocks)
            while reader.remaining:
                await asyncio.sleep(0)
                events += reader.read(self._slice_blocks)
        except ValueError as exc:
            self._skip(feed, seq, exc)
            return None
        return reader.ts, list(split_events(events, self._slice_blocks)) or [[]]

    def _apply(
        self, feed: Feed, seq: int, ts: float, events: list[KvEvent], parts: int = 1
    ) -> KvOutcome | None:
        """One call into the fleet: the first of ``parts`` parts of batch ``seq`` (or, after
        that, its next part); None when applying raised (counted, view dropped)."""
        try:
            if parts > 1:
                self.fleet.kv_expect_parts(feed.url, seq, parts)
            lag_s = max(0.0, self._wall() - ts)
            return self.fleet.apply_kv_batch(feed.url, seq, ts, events, self._clock(), lag_s=lag_s)
        except Exception as exc:  # a bug in the core must not stop the feed
            self._skip(feed, seq, exc)
            return None

    @staticmethod
    def _bad_message(feed: Feed, frames: list[bytes], form: str) -> None:
        """A message not framed as ``form``: ignored, counted, logged as skipped batches are
        (1, 2, 4, 8, ...: O(log n) lines for a flood)."""
        feed.num_bad += 1
        n = feed.num_bad
        if n & (n - 1) == 0:
            sizes = ", ".join(str(len(f)) for f in frames[:8])
            log.warning(
                "KV message from %s ignored (%d so far): %d frames of %s bytes, not %s",
                feed.url,
                n,
                len(frames),
                sizes + (", ..." if len(frames) > 8 else ""),
                form,
            )

    def _skip(self, feed: Feed, seq: int, error: Exception) -> None:
        """Batch ``seq`` is lost: count it, and stop trusting the view (as after a gap)."""
        feed.num_malformed += 1
        n = feed.num_malformed
        self.fleet.kv_gap_unfilled(feed.url, seq + 1)
        approximate = not self.fleet.is_exact(feed.url)
        # 1, 2, 4, 8, ...: a flood of bad batches logs O(log n) lines; and the first of
        # each episode of being approximate
        if n & (n - 1) == 0 or (approximate and not feed.warned):
            log.warning(
                "KV batch %d of %s skipped (%d so far): %s%s",
                seq,
                feed.url,
                n,
                error,
                f"; {APPROXIMATE_NOTE}" if approximate else "",
                exc_info=None if isinstance(error, ValueError) else error,
            )
        feed.warned = feed.warned or approximate

    async def _replay(self, feed: Feed, start: int) -> tuple[int, bool]:
        """Ask the engine for batches ``>= start`` and apply them; returns how many came
        and whether the last answer ended with its end marker.

        An answer cut short (no end marker), or missing a batch after its first, is
        resumed from the next batch the view needs, as long as each answer brings some
        (module doc). A buffer that no longer reaches
        back to ``start`` leaves a gap: the backend goes approximate and the stream
        continues from the first batch the buffer still has.
        """
        received = 0
        while True:
            got, complete = await self._replay_once(feed, start)
            received += got
            resume = self.fleet.kv_next_seq(feed.url)
            if complete or not got or resume is None or resume <= start:
                return received, complete
            log.info(
                "KV event replay from %s came in pieces: %d batches from %d, asking from %d",
                feed.replay_endpoint,
                got,
                start,
                resume,
            )
            start = resume

    async def _replay_once(self, feed: Feed, start: int) -> tuple[int, bool]:
        """One replay request: (batches received, whether the end marker came)."""
        assert self._ctx is not None and feed.replay_endpoint is not None
        feed.num_replays += 1
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, self._rcv_hwm)  # queue what the engine sends at once
        sock.connect(feed.replay_endpoint)
        received = 0
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                # the first frame may wait for a busy engine; then they come back to back
                timeout_s = self._replay_timeout_s
                if received:
                    timeout_s = min(timeout_s, REPLAY_IDLE_S)
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
                if len(frames) < 2 or len(frames[-2]) != 8:
                    self._bad_message(feed, frames, "a replay's [..., 8-byte seq, payload]")
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return received, True
                expected = self.fleet.kv_next_seq(feed.url)
                if received and expected is not None and seq > expected:
                    return received, False  # lost in transit, still buffered: ask again
                received += 1
                await self._handle(feed, seq, frames[-1], replay=False)
                await asyncio.sleep(0)
        except TimeoutError:
            if not received:
                log.warning("KV event replay from %s timed out", feed.replay_endpoint)
        finally:
            sock.close(linger=0)
        return received, False
