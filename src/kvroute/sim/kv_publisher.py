"""KV-cache events over ZMQ in vLLM's wire format, one publisher per backend.

Like vLLM's ``ZmqEventPublisher``: a PUB socket bound to ``endpoint`` sends each batch
as three frames ``[topic, 8-byte big-endian sequence number, msgpack batch]`` (the batch
from ``engine.kv_events.encode_batch``). Sequence numbers start at 0 and grow by one
per batch, so a subscriber sees a gap when the high-water mark dropped one.

Optionally a ROUTER socket on ``replay_endpoint`` serves missed batches: a DEALER
sends ``[b"", start_seq (8 bytes big-endian)]`` and receives ``[b"", seq, batch]`` for
each buffered batch with ``seq >= start_seq``, then ``[b"", -1 (8 bytes, signed), b""]``.

Sending never blocks the event loop: PUB drops when the peer is slow (``zmq.NOBLOCK``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvroute.engine.kv_events import KvEvent, encode_batch

DEFAULT_TOPIC = "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    """Publishes engine KV events on a bound PUB socket (and serves replays)."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = DEFAULT_TOPIC,
        replay_endpoint: str | None = None,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(_bindable(endpoint))
        # the resolved endpoint ("tcp://127.0.0.1:*" becomes the bound port)
        self.endpoint = _connectable(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.replay_endpoint: str | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint is not None:
            actx = zmq.asyncio.Context(shadow=self._ctx)
            self._replay = actx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(_bindable(replay_endpoint))
            self.replay_endpoint = _connectable(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Start serving replays (needs a running event loop); no-op without replay."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> None:
        """Send one batch (no-op when empty); drops it if the socket is full."""
        if not events:
            return
        payload = encode_batch(time.time() if ts is None else ts, list(events))
        seq = self._seq
        self._seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        if self._replay is not None:
            self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None, "replay task runs only with a replay socket"
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client, b"", seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._replay is not None:
            self._replay.close()
        self._pub.close()


def _bindable(endpoint: str) -> str:
    """Port 0 means any free port, as for HTTP."""
    return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint


def _connectable(endpoint: str) -> str:
    """A bound ``tcp://0.0.0.0:P`` or ``tcp://*:P`` as a subscriber can connect to it."""
    for wild in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wild):
            return "tcp://127.0.0.1:" + endpoint[len(wild) :]
    return endpoint
