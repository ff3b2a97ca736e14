"""Exact mode bookkeeping: per-backend KV event streams, model swaps, speculation.

One ``KvStream`` per backend follows the publisher's sequence numbers (one per batch,
from 0). A backend is *synced* when the router has applied every batch the engine ever
published (it saw seq 0, or the replay buffer proved there was none), or everything since
an ``AllBlocksCleared`` (the engine's cache was empty then). While synced, its index model
is an ``EventCacheModel``; otherwise it falls back to the approximate ``LruCacheModel``
(seeded with what the exact model last showed).

Sequence rules for a batch with number ``seq`` when ``last_seq`` was applied last:
``seq == last_seq + 1`` applies; ``seq <= last_seq`` is a duplicate (a replay overlapping
the live stream), unless it is 0 or newer in time than the last batch, which means the
engine restarted (its cache is new: start clean); ``seq > last_seq + 1`` is a gap. On a
gap the caller may replay from ``next_seq``; if it cannot fill it, ``gap_unfilled`` makes
the backend approximate until the engine's next ``AllBlocksCleared``.

A large batch may be applied in parts (``expect_parts``), so the caller can yield
between them: the parts arrive as calls with the same ``seq``, and ``last_seq`` moves to
it with the last one. A batch whose parts stopped coming (or whose apply raised) counts
as lost: ``gap_unfilled(url, seq + 1)``, or the next batch, makes the backend approximate.

A replay of the engine's history (``begin_catch_up`` .. ``end_catch_up``) builds the
view apart from the index: until the replay reaches the present, the view shows an
earlier point of the history (on a real engine, the prompts of earlier runs, long
evicted), and routing on it sends requests for hits that are gone. Meanwhile the backend
stays approximate; a replay that ends complete swaps the view in, one that does not
leaves the backend approximate until its next reset.

What a view follows: one KV cache group of the engine. A hybrid model (vLLM's groups:
full attention beside sliding-window or Mamba layers) publishes each block once per
group under the same hash, and a sliding-window group drops blocks the full-attention
group keeps; following every group, one group's removal took blocks from the view that
the engine still hits. The view follows the first group announced as full attention
(MLA included), or group 0 when the engine names no kinds; events without a group are
the only group's. Stores it cannot key are skipped (``num_skipped``): blocks of
another size than the backend's keys (another group's, SGLang's short last page, a
partial vLLM entry), or token ids that do not cover the hashes one block each.

Caps: the exact views together hold at most the index's ``max_entries`` engine blocks,
and each at most ``max_stored_blocks`` (default: the same). A ``BlockStored`` that would
pass either makes that backend approximate (``num_overflows``) until its next reset: an
engine cannot hold more blocks than the router was sized for, so its stream is wrong.

Everything here is pure; the router's subscriber does the I/O.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.common.hashing import chain_seed
from kvroute.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    cache_salt_of,
)
from kvroute.core.event_model import EventCacheModel
from kvroute.core.index import LruCacheModel, PrefixIndex


class KvOutcome(enum.Enum):
    """What ``apply_batch`` did with one batch."""

    APPLIED = "applied"  # in order: applied (or scanned for a reset while not synced)
    DUPLICATE = "duplicate"  # already applied: skipped
    GAP = "gap"  # batches are missing before it: nothing applied; replay from next_seq
    UNKNOWN = "unknown"  # no such backend


@dataclass(slots=True)
class KvStream:
    """One backend's event stream as far as the router has followed it."""

    last_seq: int = -1  # last applied batch number; -1 before the first
    last_ts: float | None = None  # engine timestamp of that batch, seconds
    synced: bool = False  # every batch since the engine's start (or last reset) applied
    gap_at: int | None = None  # next_seq when the pending gap was found (counted once)
    num_gaps: int = 0  # gaps found
    num_restarts: int = 0  # engine restarts seen (sequence went back)
    num_batches: int = 0  # batches applied
    num_events: int = 0  # events in them
    lag_s: float | None = None  # receive time - engine timestamp of the last batch
    num_overflows: int = 0  # exact view dropped for passing its cap
    num_skipped: int = 0  # stores not keyed: another block size, or tokens not matching
    group: int | None = None  # the KV cache group followed (module doc); None: not seen
    # tokens per block of the backend's keys: given by the caller, else the first store's
    block_size: int | None = None
    # calls still owed for batch next_seq, whose first part is applied: its parts to come,
    # or 1 while one is applied (left set if applying raised); last_seq moves to it once
    # every part is in, so a nonzero value means the view holds part of that batch
    parts_left: int = 0
    announced: tuple[int, int] | None = None  # (seq, parts) from expect_parts, unused yet

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    def classify(self, seq: int, ts: float) -> str:
        """ "next", "duplicate", "restart" or "gap" (module doc)."""
        if seq == self.last_seq + 1:
            return "next"
        if seq <= self.last_seq:
            newer = self.last_ts is not None and ts > self.last_ts
            return "restart" if seq == 0 or newer else "duplicate"
        return "gap"


# KV cache kinds whose blocks hold a prefix as long as it is cached (vLLM's
# KVCacheSpecKind values): the group a view follows
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention"})


def _follows(s: KvStream, event: BlockStored | BlockRemoved) -> bool:
    """Whether ``event`` is of the group ``s`` follows (choosing it at its first store)."""
    group = event.group_idx
    if group is None:
        return True
    if s.group is None and isinstance(event, BlockStored):
        kind = event.kv_cache_spec_kind
        if kind in FULL_ATTENTION_KINDS or (kind is None and group == 0):
            s.group = group
    return group == s.group


def _keyable(s: KvStream, event: BlockStored) -> bool:
    """Whether ``event``'s blocks can be keyed as the backend's requests are."""
    if len(event.token_ids) != event.block_size * len(event.block_hashes):
        return False
    if s.block_size is None:
        s.block_size = event.block_size
    return event.block_size == s.block_size


@dataclass(frozen=True, slots=True)
class _Speculation:
    url: str  # backend credited
    model: EventCacheModel  # the model credited (ignored once swapped out)
    keys: Sequence[int]  # the request's router keys


class ExactSync:
    """Streams, model swaps and speculative entries for every backend of one index."""

    def __init__(
        self,
        index: PrefixIndex,
        mode: str,
        speculative_ttl_s: float,
        max_stored_blocks: int | None = None,
    ) -> None:
        self.index = index
        self.mode = mode
        self.speculative_ttl_s = speculative_ttl_s
        # one exact view's cap (engine blocks); all of them together: index.max_entries
        if max_stored_blocks is not None and max_stored_blocks < 1:
            raise ValueError("max_stored_blocks must be >= 1")
        self._max_stored_blocks = max_stored_blocks
        self.url_to_stream: dict[str, KvStream] = {}
        # views being rebuilt by a replay: not in the index until it reaches the present
        self._catching_up: dict[str, EventCacheModel | None] = {}
        self._queue: deque[tuple[float, int]] = deque()  # (expiry, ticket id), by expiry
        self._ticket_to_spec: dict[int, _Speculation] = {}

    @property
    def max_stored_blocks(self) -> int:
        """One exact view's cap: as given, else the index's (which may follow the fleet)."""
        return self._max_stored_blocks or self.index.max_entries

    def add_backend(self, url: str) -> None:
        self.url_to_stream[url] = KvStream()

    def remove_backend(self, url: str) -> None:
        self.url_to_stream.pop(url, None)
        self._catching_up.pop(url, None)

    def begin_catch_up(self, url: str) -> None:
        """A replay of ``url``'s history starts: a view it syncs stays out of the index."""
        if url in self.url_to_stream:
            self._catching_up.setdefault(url, None)

    def end_catch_up(self, url: str, complete: bool) -> None:
        """The replay ended: reaching the present (``complete``), its view goes into the
        index; otherwise it is dropped and the backend stays approximate until its next
        reset (what it missed is unknown)."""
        if url not in self._catching_up:
            return
        view = self._catching_up.pop(url)
        s = self.url_to_stream.get(url)
        if view is None or s is None or not s.synced:
            return
        if complete:
            # sized when the replay began: the engine's size may have been scraped since
            view.set_capacity(self.index.url_to_model[url].capacity_blocks)
            self.index.replace_model(url, view)
        else:
            s.synced = False

    def is_exact(self, url: str) -> bool:
        return isinstance(self.index.url_to_model.get(url), EventCacheModel)

    def model(self, url: str) -> EventCacheModel | None:
        m = self.index.url_to_model.get(url)
        return m if isinstance(m, EventCacheModel) else None

    # -- streams ---------------------------------------------------------------------------

    def expect_parts(self, url: str, seq: int, parts: int) -> None:
        """The next ``apply_batch`` call for ``url`` is the first of ``parts`` calls that
        carry batch ``seq`` in order (the announcement is used up by that next call)."""
        s = self.url_to_stream.get(url)
        if s is not None:
            s.announced = (seq, max(1, parts))

    def apply_batch(
        self,
        url: str,
        seq: int,
        ts: float,
        events: Sequence[KvEvent],
        lag_s: float | None,
        block_size: int | None = None,
    ) -> KvOutcome:
        """Apply batch ``seq`` of ``url`` (module doc); ``block_size``: the tokens per block
        of the backend's keys when known (else the first store's is taken)."""
        s = self.url_to_stream.get(url)
        if s is None:
            return KvOutcome.UNKNOWN
        if block_size is not None:
            s.block_size = block_size
        announced, s.announced = s.announced, None
        if s.parts_left and seq == s.next_seq:  # the next part of a batch being applied
            s.num_events += len(events)
            self._apply_parts(url, s, seq, events)
            return KvOutcome.APPLIED
        if s.parts_left:  # another batch while parts were owed: that one is incomplete
            self.gap_unfilled(url, s.next_seq + 1)
        kind = s.classify(seq, ts)
        if kind == "restart":
            s.num_restarts += 1
            self._fall_back(url, s, seed=False)  # the engine's cache is gone
            s.last_seq, s.last_ts, s.gap_at = -1, None, None
            s.group = None  # a new engine may be another model
            kind = s.classify(seq, ts)
        if kind == "duplicate":
            return KvOutcome.DUPLICATE
        if kind == "gap":
            if s.gap_at != s.next_seq:
                s.gap_at = s.next_seq
                s.num_gaps += 1
            return KvOutcome.GAP
        s.last_ts, s.gap_at, s.lag_s = ts, None, lag_s
        s.num_batches += 1
        s.num_events += len(events)
        s.parts_left = announced[1] if announced is not None and announced[0] == seq else 1
        if seq == 0:
            self._sync(url, s)  # the engine's whole history starts here
        self._apply_parts(url, s, seq, events)
        return KvOutcome.APPLIED

    def _apply_parts(self, url: str, s: KvStream, seq: int, events: Sequence[KvEvent]) -> None:
        """Apply one part of batch ``seq``; the batch counts as applied after its last."""
        self._apply_events(url, s, events)
        s.parts_left -= 1
        if not s.parts_left:
            s.last_seq = seq

    def history_empty(self, url: str) -> None:
        """The engine's replay buffer is empty: it never published, its cache holds nothing."""
        s = self.url_to_stream.get(url)
        if s is not None and s.last_seq == -1:
            self._sync(url, s)

    def gap_unfilled(self, url: str, resume_seq: int) -> None:
        """Batches before ``resume_seq`` are lost (a batch applied in part included):
        approximate until the next reset."""
        s = self.url_to_stream.get(url)
        if s is None:
            return
        cut_short, s.parts_left = s.parts_left > 0, 0  # a part-applied batch is lost too
        if resume_seq <= s.next_seq and not cut_short:
            return
        self._fall_back(url, s, seed=True)
        s.last_seq, s.gap_at = max(s.last_seq, resume_seq - 1), None

    def _apply_events(self, url: str, s: KvStream, events: Sequence[KvEvent]) -> None:
        if self.mode == "approximate":
            return
        model = self._view(url) if s.synced else None
        # room left under the fleet-wide cap once the other exact views are counted
        others = sum(m.num_stored for u in self.url_to_stream if u != url and (m := self.model(u)))
        room = min(self.max_stored_blocks, self.index.max_entries - others)
        mirror = self._mirror(url)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                if model is None:
                    self._sync(url, s)
                    model = self._view(url)
                else:
                    mirror(url, (), model.clear())
            elif model is None or event.medium not in (None, "GPU"):
                continue  # not synced yet, or another tier (CPU offload)
            elif not _follows(s, event):
                continue  # another KV cache group of a hybrid model
            elif isinstance(event, BlockStored):
                if not _keyable(s, event):
                    s.num_skipped += 1
                    continue
                if model.num_stored + len(event.block_hashes) > room:
                    s.num_overflows += 1
                    self._fall_back(url, s, seed=False)  # a seed would cost O(cap) here
                    model = None
                    continue
                added = model.store(
                    event.block_hashes, event.parent_block_hash, event.token_ids,
                    event.block_size, chain_seed(cache_salt_of(event), event.lora_name),
                )  # fmt: skip
                mirror(url, added, ())
            elif isinstance(event, BlockRemoved):
                mirror(url, (), model.remove(event.block_hashes))

    def _view(self, url: str) -> EventCacheModel | None:
        """The exact view events go to: the one a replay rebuilds, else the index's."""
        apart = self._catching_up.get(url)
        return apart if apart is not None else self.model(url)

    def _mirror(self, url: str) -> Callable[[str, Sequence[int], Sequence[int]], None]:
        """How a view's changes reach the index: not at all while a replay rebuilds it."""
        if url in self._catching_up:
            return lambda url, added, removed: None
        return self.index.apply

    def _sync(self, url: str, s: KvStream) -> None:
        """Start an exact view from an empty engine cache (apart while catching up)."""
        s.synced = self.mode != "approximate"
        if s.synced:
            capacity = self.index.url_to_model[url].capacity_blocks
            if url in self._catching_up:
                self._catching_up[url] = EventCacheModel(capacity)
            else:
                self.index.replace_model(url, EventCacheModel(capacity))

    def _fall_back(self, url: str, s: KvStream, *, seed: bool) -> None:
        """Back to the approximate model, seeded with the exact view when still meaningful."""
        s.synced = False
        if self._catching_up.get(url) is not None:
            self._catching_up[url] = None  # a view of the past: nothing to seed with
        old = self.model(url)
        if old is None:
            if not seed:  # a restart: whatever the LRU guessed is gone too
                capacity = self.index.url_to_model[url].capacity_blocks
                self.index.replace_model(url, LruCacheModel(capacity))
            return
        lru = LruCacheModel(old.nominal_capacity)
        if seed:
            lru.seed(old.blocks())
        self.index.replace_model(url, lru)

    # -- speculation -------------------------------------------------------------------------

    def speculate(self, url: str, ticket_id: int, keys: Sequence[int], now: float) -> bool:
        """Credit ``url`` with a dispatched request's keys; False if it is not exact."""
        model = self.model(url)
        if model is None:
            return False
        if self.speculative_ttl_s <= 0 or not keys:
            return True
        self.index.apply(url, model.speculate(keys, ticket_id), ())
        self._ticket_to_spec[ticket_id] = _Speculation(url, model, keys)
        self._queue.append((now + self.speculative_ttl_s, ticket_id))
        return True

    def withdraw(self, ticket_id: int) -> None:
        """Drop a request's unconfirmed speculative keys (failed or expired)."""
        spec = self._ticket_to_spec.pop(ticket_id, None)
        if spec is None or self.index.url_to_model.get(spec.url) is not spec.model:
            return
        self.index.apply(spec.url, (), spec.model.unspeculate(spec.keys, ticket_id))

    def expire(self, now: float) -> None:
        """Withdraw speculations whose TTL has passed (O(1) when none is due)."""
        queue = self._queue
        while queue and queue[0][0] <= now:
            self.withdraw(queue.popleft()[1])

    def check_invariants(self) -> None:
        assert set(self.url_to_stream) == set(self.index.url_to_model), "sync: membership"
        for url, s in self.url_to_stream.items():
            model = self.model(url)
            apart = self._catching_up.get(url)
            assert model is None or apart is None, f"sync: {url} has two exact views"
            assert (model is not None or apart is not None) == s.synced, (
                f"sync: {url} model kind != synced"
            )
            if model is not None:
                model.check_invariants()
                assert model.num_stored <= self.max_stored_blocks, f"sync: {url} over its cap"
        exact = [m.num_stored for u in self.url_to_stream if (m := self.model(u))]
        assert sum(exact) <= self.index.max_entries, "sync: exact views over the index cap"
