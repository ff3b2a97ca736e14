"""Ground truth from a real engine's KV events: which blocks each engine holds now.

One background thread per engine subscribes to its ZMQ PUB endpoint (three frames:
topic, 8-byte sequence number, msgpack batch) and applies every event to a set of
live block hashes. The e2e script compares that set's size with the router's view.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


@dataclass(slots=True)
class EventTally:
    """What one engine's event stream said so far (mutated only by its thread)."""

    live_blocks: set[int] = field(default_factory=set)  # hashes stored and not removed
    stored: int = 0  # blocks in BlockStored events
    removed: int = 0  # blocks in BlockRemoved events
    cleared: int = 0  # AllBlocksCleared events
    batches: int = 0  # messages received
    bad: int = 0  # messages that did not decode
    seq_gaps: int = 0  # sequence numbers skipped (dropped messages)
    last_seq: int | None = None  # sequence number of the last batch
    block_size: int | None = None  # tokens per block, from BlockStored


class EventTracker:
    """Subscribe to one engine's KV events in a daemon thread."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.endpoint = endpoint
        self.tally = EventTally()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._topic = topic
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def snapshot(self) -> EventTally:
        """A copy, so the caller reads a consistent tally."""
        with self._lock:
            t = self.tally
            return EventTally(
                set(t.live_blocks),
                t.stored,
                t.removed,
                t.cleared,
                t.batches,
                t.bad,
                t.seq_gaps,
                t.last_seq,
                t.block_size,
            )

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(200):
                    self._on_message(sock.recv_multipart())
        finally:
            sock.close()

    def _on_message(self, frames: list[bytes]) -> None:
        with self._lock:
            t = self.tally
            t.batches += 1
            if len(frames) < 2:
                t.bad += 1
                return
            if len(frames) >= 3:
                seq = int.from_bytes(frames[-2], "big")
                if t.last_seq is not None and seq > t.last_seq + 1:
                    t.seq_gaps += seq - t.last_seq - 1
                t.last_seq = seq
            try:
                _, events = decode_batch(frames[-1])
            except ValueError:
                t.bad += 1
                return
            for ev in events:
                apply_event(t, ev)


def apply_event(t: EventTally, ev: object) -> None:
    """Fold one decoded event into the tally."""
    if isinstance(ev, BlockStored):
        t.live_blocks.update(ev.block_hashes)
        t.stored += len(ev.block_hashes)
        t.block_size = ev.block_size
    elif isinstance(ev, BlockRemoved):
        t.live_blocks.difference_update(ev.block_hashes)
        t.removed += len(ev.block_hashes)
    elif isinstance(ev, AllBlocksCleared):
        t.live_blocks.clear()
        t.cleared += 1
