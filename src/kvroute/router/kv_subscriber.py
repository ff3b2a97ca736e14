"""KV-cache event subscriber: one ZMQ SUB per backend feeding ``Fleet.apply_kv_batch``.

``KvEventSubscriber`` keeps one feed per backend that publishes KV events (added and
removed with the backend), starts and stops them with the app, restarts a failed one, and
reports each feed's state (``KvSubscriberStatus``: metrics, the status page, /admin/kv).
What one run of a feed does (receive, decode, apply, replay the batches a gap lost, fall
back to the approximate model when they cannot be had) is router/kv_feed.py's.

If a feed's task fails (a socket error, or a bug), it is logged and restarted with
exponential backoff (``num_feed_restarts``); a run that received nothing also drops the
view. Queued memory is at most ``rcv_hwm``
messages of ``max_message_bytes`` per socket: a backend's SUB, and its DEALER during a
replay.
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

from kvroute.common.kv_events import DEFAULT_LIMITS, KvEventLimits
from kvroute.core.fleet import Fleet
from kvroute.router.kv_feed import SYNC_GRACE_S, Feed, KvFeedMixin

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # ZMQ_MAXMSGSIZE: real batches stay under 1 MB
RCV_HWM = 10_000  # messages queued per SUB before ZMQ drops (shows as a gap)
SLICE_BLOCKS = 2048  # blocks decoded or applied between two yields to the loop
RESTART_BACKOFF_S = (0.1, 10.0)  # first and longest wait before restarting a failed feed
STABLE_RUN_S = 30.0  # a run this long resets the backoff


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
    num_bad_messages: int  # messages not framed as [topic, seq, payload]: ignored
    num_malformed_batches: int  # batches that failed to decode or apply: skipped
    num_feed_restarts: int  # times the feed task failed and was restarted
    num_overflows: int  # times the exact view passed its cap and was dropped
    num_skipped: int  # stores not keyed: another block size, tokens not matching hashes
    num_disconnects: int  # connections to the publisher lost (and made again)


class KvEventSubscriber(KvFeedMixin):
    """Follows every backend's KV events into ``fleet`` (module doc).

    ``backends`` maps backend URL -> PUB endpoint, ``replay`` URL -> replay endpoint.
    ``clock`` is the fleet's clock (its ``now``); ``wall`` measures lag against the
    engine's timestamps (the engines' wall clocks). ``limits`` bounds one batch,
    ``max_message_bytes`` one ZMQ message, ``rcv_hwm`` the messages queued per backend.
    A feed still approximate ``sync_grace_s`` after subscribing says why (router/kv_feed.py).
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
        limits: KvEventLimits = DEFAULT_LIMITS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        rcv_hwm: int = RCV_HWM,
        slice_blocks: int = SLICE_BLOCKS,
        restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S,
        sync_grace_s: float = SYNC_GRACE_S,
    ) -> None:
        if max_message_bytes < 1 or rcv_hwm < 1 or slice_blocks < 1:
            raise ValueError("max_message_bytes, rcv_hwm and slice_blocks must be >= 1")
        if not 0 < restart_backoff_s[0] <= restart_backoff_s[1]:
            raise ValueError("restart_backoff_s must be (first, longest) with 0 < first <= longest")
        self.fleet = fleet
        self._clock = clock
        self._wall = wall
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self._limits = limits
        self._max_message_bytes = max_message_bytes
        self._rcv_hwm = rcv_hwm
        self._slice_blocks = slice_blocks
        self._backoff = restart_backoff_s
        self._sync_grace_s = sync_grace_s
        self._ctx: zmq.asyncio.Context | None = None
        self._feeds: dict[str, Feed] = {}
        for url, endpoint in (backends or {}).items():
            self._feeds[url] = Feed(url, endpoint, (replay or {}).get(url))

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
        feed = Feed(url, endpoint, replay_endpoint)
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
        stream = self.fleet.kv_stream(url)
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
            num_malformed_batches=feed.num_malformed,
            num_feed_restarts=feed.num_restarts,
            num_overflows=stream.num_overflows if stream is not None else 0,
            num_skipped=stream.num_skipped if stream is not None else 0,
            num_disconnects=feed.num_disconnects,
        )

    def urls(self) -> list[str]:
        return sorted(self._feeds)

    def _launch(self, feed: Feed) -> None:
        if feed.task is None or feed.task.done():
            name = f"kv-events-{feed.url}"
            feed.task = asyncio.get_running_loop().create_task(self._run(feed), name=name)

    @staticmethod
    async def _cancel(feed: Feed) -> None:
        if feed.task is not None:
            feed.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed.task
            feed.task = None

    # -- supervision (one run of a feed: KvFeedMixin._follow) -----------------------------

    async def _run(self, feed: Feed) -> None:
        """Follow ``feed``; restart it with backoff whenever it fails (module doc)."""
        delay = self._backoff[0]
        while True:
            started, received = self._clock(), feed.num_received
            try:
                await self._follow(feed)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # stop() or remove_backend()
                error: BaseException = ConnectionError("a receive was cancelled under it")
            except Exception as exc:  # a socket error, or a bug: routing must go on
                error = exc
            feed.num_restarts += 1
            if feed.num_received == received:  # it gets nothing: stop trusting the view
                next_seq = self.fleet.kv_next_seq(feed.url)
                if next_seq is not None:
                    self.fleet.kv_gap_unfilled(feed.url, next_seq + 1)
            if self._clock() - started >= STABLE_RUN_S:
                delay = self._backoff[0]
            log.warning(
                "KV event feed of %s failed (%r); restart %d in %.1f s",
                feed.url,
                error,
                feed.num_restarts,
                delay,
                # the error itself: sys.exc_info() is empty once its except block has ended
                exc_info=None if isinstance(error, (zmq.ZMQError, ConnectionError)) else error,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff[1])
