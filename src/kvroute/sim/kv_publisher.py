"""KV-cache events over ZMQ in vLLM's wire format, one publisher per backend.

Like vLLM's ``ZmqEventPublisher``: a PUB socket bound to ``endpoint`` sends each batch
as three frames ``[topic, 8-byte big-endian sequence number, msgpack batch]`` (the batch
from ``common.kv_events.encode_batch``). Sequence numbers start at 0 and grow by one
per batch, so a subscriber sees a gap when the high-water mark dropped one.

Optionally a ROUTER socket on ``replay_endpoint`` serves missed batches: a DEALER
sends ``[b"", start_seq (8 bytes big-endian)]`` and receives ``[b"", seq, batch]`` for
each buffered batch with ``seq >= start_seq``, then ``[b"", -1 (8 bytes, signed), b""]``.

Sending never blocks the event loop: PUB drops when the peer is slow (``zmq.NOBLOCK``).

Faults (sim/faults.py) make the stream unreliable on purpose: ``kv_gap_every`` loses a
batch for good (its number is skipped: neither sent nor buffered), ``kv_garbage_every``
adds a malformed message (``garbage_message``) after a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvroute.common.kv_events import KvEvent, encode_batch
from kvroute.sim.faults import Faults

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
        faults: Faults | None = None,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode()
        self._seq = 0
        self._faults = faults
        self.num_batches = 0  # batches the engine handed over (lost ones included)
        self.num_lost = 0  # batches a kv_gap fault dropped
        self.num_garbage = 0  # malformed messages a kv_garbage fault sent
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint: str | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        try:
            _bind(self._pub, endpoint, "publish KV events")
            # the resolved endpoint ("tcp://127.0.0.1:*" becomes the bound port)
            self.endpoint = _connectable(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
            if replay_endpoint is not None:
                actx = zmq.asyncio.Context(shadow=self._ctx)
                self._replay = actx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _bind(self._replay, replay_endpoint, "serve KV replays")
                self.replay_endpoint = _connectable(
                    self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                )
        except OSError:
            if self._replay is not None:
                self._replay.close()
            self._pub.close()
            raise

    def start(self) -> None:
        """Start serving replays (needs a running event loop); no-op without replay."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> None:
        """Send one batch (no-op when empty); drops it if the socket is full."""
        if not events:
            return
        ts = time.time() if ts is None else ts
        self.num_batches += 1
        faults = self._faults
        if faults is not None and _every(faults.kv_gap_every, self.num_batches):
            self._seq += 1  # lost for good: a gap no replay fills
            self.num_lost += 1
            return
        self._send(encode_batch(ts, list(events)))
        if faults is not None and _every(faults.kv_garbage_every, self.num_batches):
            frames, uses_seq = garbage_message(self.num_garbage, self._topic, self._seq, ts)
            self.num_garbage += 1
            if uses_seq:
                self._send(frames[2])
            else:
                self._send_frames(frames)

    def _send(self, payload: bytes) -> None:
        """Number, buffer and send one batch payload."""
        seq = self._seq
        self._seq += 1
        if self._replay is not None:
            self._buffer.append((seq, payload))
        self._send_frames((self._topic, seq.to_bytes(8, "big"), payload))

    def _send_frames(self, frames: Sequence[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

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


def _every(k: int | None, n: int) -> bool:
    return k is not None and n % k == 0


def garbage_message(i: int, topic: bytes, seq: int, ts: float) -> tuple[list[bytes], bool]:
    """The ``i``-th malformed message of a ``kv_garbage`` fault (they rotate).

    Returns the frames and whether the message is a numbered batch (sequence ``seq``,
    buffered for replay like any batch) or frame-level junk that carries no usable number.
    Each shape is one a real subscriber may meet: a truncated or foreign message, bytes
    that are not msgpack, and decodable batches with events of the wrong shape (a list
    as event tag, an infinite block size, a string where a list belongs).
    """
    seq_bytes = seq.to_bytes(8, "big")
    tokens = list(range(16))
    batches: list[Any] = [
        b"\xc1 not msgpack",
        {"not": "a batch"},
        [ts, "events should be a list"],
        [ts, [[["BlockStored"], [1], None, tokens, 16]]],
        [ts, [["BlockStored", [1], None, tokens, float("inf")]]],
        [ts, [["BlockRemoved", "not a list of hashes"]]],
        [ts, [["BlockStored", [1, 2], None, tokens, 16, None, "GPU", None, "x"]]],
    ]
    frames_only: list[list[bytes]] = [
        [topic, seq_bytes],  # two frames
        [topic, seq_bytes[:3], b"\x92\x00\x90"],  # short sequence number
        [topic, seq_bytes, b"\x92\x00\x90", b"extra"],  # four frames
    ]
    shapes = len(batches) + len(frames_only)
    k = i % shapes
    if k < len(frames_only):
        return frames_only[k], False
    raw = batches[k - len(frames_only)]
    payload = raw if isinstance(raw, bytes) else msgspec.msgpack.encode(raw)
    return [topic, seq_bytes, payload], True


def _bind(sock: zmq.Socket[Any], endpoint: str, what: str) -> None:
    """Bind ``sock``; an OSError saying what could not be done where, and why."""
    try:
        sock.bind(_bindable(endpoint))
    except zmq.ZMQError as exc:
        error = OSError(f"cannot {what} on {endpoint}: {zmq.strerror(exc.errno)}")
        error.errno = exc.errno
        raise error from exc


def _bindable(endpoint: str) -> str:
    """Port 0 means any free port, as for HTTP."""
    return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint


def _connectable(endpoint: str) -> str:
    """A bound ``tcp://0.0.0.0:P`` or ``tcp://*:P`` as a subscriber can connect to it."""
    for wild in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wild):
            return "tcp://127.0.0.1:" + endpoint[len(wild) :]
    return endpoint
