"""Which backend holds which prefix: a global block -> holders map over per-backend cache models.

Each backend has a ``CacheModel``: what the router believes is in that engine's prefix
cache, in engine blocks: ``LruCacheModel`` (approximate mode: fed by the router's own
dispatches) or ``core/event_model.EventCacheModel`` (exact mode: fed by the engine's KV
events, its changes mirrored through ``PrefixIndex.apply``). ``replace_model`` swaps one
for the other when a backend's event stream becomes consistent or breaks.

Blocks are chained keys (common/hashing.py): a key determines its whole prefix. Every model
keeps its holdings contiguous (a block is held only if its parent is), so the holders of
block i+1 are a subset of the holders of block i. ``levels`` uses that nesting to find
every holder's match depth with O(distinct depths x log(prompt blocks)) lookups, not a
walk over the fleet.

Holder sets are bitmasks over backend slots (an int per block): a one-holder entry costs
a dict slot and a small int instead of a Python set, which is what lets the global cap
be large.
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from operator import or_

from kvroute.common.hashing import leading_in

# What one model adds to an index sized to its models, at most: 2**22 blocks (67M tokens
# at 16 a block, many times the largest engine's KV), so an absurd num_gpu_blocks gauge
# cannot lift the cap on the router's memory
MAX_SIZED_BLOCKS = 1 << 22


class CacheModel(abc.ABC):
    """One backend's prefix cache as the router models it (blocks, not tokens).

    Contract: holdings are contiguous along each chain; ``insert`` returns exactly the
    blocks that became held and those that stopped being held, so the index can mirror it.
    """

    @property
    @abc.abstractmethod
    def capacity_blocks(self) -> int:
        """The blocks the model holds at most (``set_capacity`` changes it)."""

    @property
    def nominal_capacity_blocks(self) -> int:
        """The size the model was given (``capacity_blocks`` unless a model may hold more
        than that): what an index sized to its models counts."""
        return self.capacity_blocks

    @abc.abstractmethod
    def holds(self, block_hash: int) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def blocks(self) -> Iterator[int]:
        """Every held block, in eviction order (next to evict first)."""

    @abc.abstractmethod
    def insert(
        self, block_hashes: Sequence[int], num_held: int, seq: int
    ) -> tuple[Sequence[int], list[int]]:
        """Touch a request's prefix, of which the first ``num_held`` blocks are already held.

        Returns (blocks newly held, blocks evicted).
        """

    @abc.abstractmethod
    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Resize; returns the blocks evicted to fit."""

    @abc.abstractmethod
    def oldest_seq(self) -> int | None:
        """Sequence number of the next block to evict (None when empty); orders the cap."""

    @abc.abstractmethod
    def evict_oldest(self) -> int | None:
        """Evict the next block in eviction order; None when empty."""


class LruCacheModel(CacheModel):
    """Capacity-bounded LRU in engine blocks, evicting like vLLM's free-block queue.

    Order invariant: the OrderedDict is in eviction order (front first). A request's
    blocks are touched tail first, so its tail sits ahead of its head and is evicted
    first among blocks of equal recency, as the engine frees a request's blocks in
    reverse. A parent is touched in the same insert as its children and after them, so
    it never precedes a child in the order: eviction from the front keeps the holdings
    contiguous. Re-touching held blocks runs in C (``move_to_end`` via ``map``).

    Each block's value is the touch sequence number of the insert that added it (its
    birth), not of its last touch: rewriting 2,000 values per request would triple the
    cost of an insert. Only the global cap reads it, through ``oldest_seq`` of each
    model's front block, so the cap evicts by birth among the fronts (the LRU block of
    each model), an approximation of a global LRU; within a model the order is exact.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> touch seq

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self) -> Iterator[int]:
        return iter(self._lru)

    def insert(
        self, block_hashes: Sequence[int], num_held: int, seq: int
    ) -> tuple[Sequence[int], list[int]]:
        lru = self._lru
        n = min(len(block_hashes), self._capacity)  # a too-long prompt keeps its head
        held = block_hashes[: min(num_held, n)]
        new = block_hashes[len(held) : n]
        for h in reversed(new):  # appended tail first
            lru[h] = seq
        deque(map(lru.move_to_end, reversed(held)), maxlen=0)  # to the back, tail first
        return new, self._evict_to(self._capacity)

    def seed(self, blocks: Iterable[int], seq: int = 0) -> None:
        """Fill an empty model with ``blocks`` in eviction order (children before parents),
        keeping the last ``capacity_blocks``: a fallback from exact mode starts warm."""
        if self._lru:
            raise ValueError("seed takes an empty model")
        self._lru.update(zip(blocks, repeat(seq)))
        self._evict_to(self._capacity)

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        return self._evict_to(capacity_blocks)

    def oldest_seq(self) -> int | None:
        if not self._lru:
            return None
        return self._lru[next(iter(self._lru))]

    def evict_oldest(self) -> int | None:
        if not self._lru:
            return None
        return self._lru.popitem(last=False)[0]

    def _evict_to(self, size: int) -> list[int]:
        pop = self._lru.popitem
        return [pop(False)[0] for _ in range(len(self._lru) - size)]


class PrefixIndex:
    """Global ``hash_to_holders`` (block -> bitmask of backend slots) over per-backend models.

    ``max_entries`` None sizes the cap to the models: the sum of their nominal capacities
    (each at most ``MAX_SIZED_BLOCKS``), kept as backends come, go and change size, so the
    index holds whatever the engines' caches can (it never binds on approximate models of
    sane size, each bounded by its own capacity); a number is a hard cap on the router's
    memory for the index.

    Invariants (``check_invariants``):
    - a hash lists backend r as a holder exactly when r's cache model holds it, and no
      hash maps to an empty set;
    - the sum of the models' sizes equals ``num_entries`` and never exceeds
      ``max_entries``: the cap is enforced on every insert by evicting the globally least
      recently touched blocks (each model's front, compared by touch sequence); only
      exact-mode models, which the index never evicts, may hold it above the cap;
    - a removed backend leaves no bit behind, and its slot is reused only after that.
    """

    def __init__(self, max_entries: int | None) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1 or None, got {max_entries}")
        self.fixed_cap = max_entries  # None: the models' capacities (class doc)
        self._capacity_sum = 0  # of the models' sizes (``_sized``)
        self.hash_to_holders: dict[int, int] = {}  # block hash -> bitmask of slots
        self.url_to_model: dict[str, CacheModel] = {}
        self.url_to_slot: dict[str, int] = {}
        self.slot_to_url: dict[int, str] = {}
        self._free_slots: list[int] = []  # heap: lowest free slot first (small masks)
        self.num_entries = 0
        self._seq = 0  # global touch counter (recency across backends)

    @property
    def total_capacity_blocks(self) -> int:
        """The models' sizes together (each capped as an index sized to them caps it)."""
        return self._capacity_sum

    @property
    def max_entries(self) -> int:
        return self.fixed_cap if self.fixed_cap is not None else max(1, self.total_capacity_blocks)

    # -- membership --------------------------------------------------------------------

    def add_backend(self, url: str, model: CacheModel) -> None:
        if url in self.url_to_model:
            raise ValueError(f"backend already indexed: {url}")
        if len(model):
            raise ValueError("add_backend takes an empty cache model")
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self.url_to_slot)
        self.url_to_model[url] = model
        self.url_to_slot[url] = slot
        self.slot_to_url[slot] = url
        self._capacity_sum += _sized(model)

    def remove_backend(self, url: str) -> None:
        """Drop every entry of ``url`` at once (unknown URL: no-op)."""
        model = self.url_to_model.pop(url, None)
        if model is None:
            return
        self.num_entries -= len(model)
        self._capacity_sum -= _sized(model)
        self._drop(self.url_to_slot[url], list(model.blocks()))
        slot = self.url_to_slot.pop(url)
        del self.slot_to_url[slot]
        heapq.heappush(self._free_slots, slot)

    def replace_model(self, url: str, model: CacheModel) -> None:
        """Swap ``url``'s cache model: the old one's entries go, the new one's blocks come."""
        old = self.url_to_model[url]
        self.num_entries -= len(old)
        self._capacity_sum += _sized(model) - _sized(old)
        slot = self.url_to_slot[url]
        self._drop(slot, list(old.blocks()))
        self.url_to_model[url] = model
        self.apply(url, list(model.blocks()), ())

    def set_capacity(self, url: str, capacity_blocks: int) -> None:
        model = self.url_to_model[url]
        if model.capacity_blocks != capacity_blocks:
            before = _sized(model)
            evicted = model.set_capacity(capacity_blocks)
            self._capacity_sum += _sized(model) - before
            self.num_entries -= len(evicted)
            self._drop(self.url_to_slot[url], evicted)

    # -- updates -----------------------------------------------------------------------

    def insert(self, url: str, block_hashes: Sequence[int]) -> None:
        """Record that ``url`` now caches the prefix ``block_hashes`` (approximate mode)."""
        if not block_hashes:
            return
        self._seq += 1
        num_held = self.matched_blocks(url, block_hashes)
        # Blocks past the fleet-wide matched prefix are in no model: set them in C.
        num_known = self._num_known(block_hashes, num_held)
        added, evicted = self.url_to_model[url].insert(block_hashes, num_held, self._seq)
        split = max(0, min(len(added), num_known - num_held))
        self.apply(url, added[:split], evicted, fresh=added[split:])

    def _num_known(self, block_hashes: Sequence[int], lo: int) -> int:
        """Leading blocks of the chain held by any backend (>= lo); holdings nest."""
        return leading_in(block_hashes, self.hash_to_holders, lo)

    def apply(
        self, url: str, added: Sequence[int], removed: Sequence[int], fresh: Sequence[int] = ()
    ) -> None:
        """Mirror a change of ``url``'s model: blocks now held (``fresh``: held by no one
        before, a fast path), blocks no longer held."""
        bit = 1 << self.url_to_slot[url]
        h2h = self.hash_to_holders
        # Both updates run in C: OR the bit into existing masks, set it on fresh blocks.
        h2h.update(zip(added, map(or_, map(h2h.get, added, repeat(0)), repeat(bit)), strict=True))
        h2h.update(zip(fresh, repeat(bit)))
        self.num_entries += len(added) + len(fresh) - len(removed)
        self._drop(self.url_to_slot[url], removed)
        self._enforce_cap()

    def _drop(self, slot: int, hashes: Sequence[int]) -> None:
        keep = ~(1 << slot)
        h2h = self.hash_to_holders
        for h in hashes:
            mask = h2h[h] & keep
            if mask:
                h2h[h] = mask
            else:
                del h2h[h]

    def _enforce_cap(self) -> None:
        """Evict globally least recently touched blocks to 1/64 under the cap (amortized).

        Models whose ``oldest_seq`` is None (exact mode: the engine decides) are never
        evicted here; their size is bounded by the engine's own cache.
        """
        if self.num_entries <= self.max_entries:
            return
        target = self.max_entries - self.max_entries // 64
        heap = [
            (seq, u) for u, m in self.url_to_model.items() if (seq := m.oldest_seq()) is not None
        ]
        heapq.heapify(heap)
        while self.num_entries > target and heap:
            _, url = heapq.heappop(heap)
            model = self.url_to_model[url]
            h = model.evict_oldest()
            assert h is not None, "index: heap entry of an empty model"
            self.num_entries -= 1
            self._drop(self.url_to_slot[url], (h,))
            seq = model.oldest_seq()
            if seq is not None:
                heapq.heappush(heap, (seq, url))

    # -- queries -----------------------------------------------------------------------

    def holders(self, block_hash: int) -> set[str]:
        return set(self.urls_of(self.hash_to_holders.get(block_hash, 0)))

    def urls_of(self, mask: int) -> Iterator[str]:
        """The backends whose bits are set in ``mask``."""
        slot_to_url = self.slot_to_url
        while mask:
            low = mask & -mask
            yield slot_to_url[low.bit_length() - 1]
            mask ^= low

    def has_bit(self, mask: int, url: str) -> bool:
        slot = self.url_to_slot.get(url)
        return slot is not None and bool((mask >> slot) & 1)

    def matched_blocks(self, url: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` held by ``url`` (binary search on contiguity)."""
        model = self.url_to_model.get(url)
        if model is None or not block_hashes or not model.holds(block_hashes[0]):
            return 0
        lo, hi = 1, len(block_hashes)  # held(lo - 1) is true; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if model.holds(block_hashes[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def levels(self, block_hashes: Sequence[int]) -> Iterator[tuple[int, int]]:
        """(depth, mask of holders whose match is exactly depth blocks), deepest first."""
        h2h = self.hash_to_holders
        n = len(block_hashes)

        def size(i: int) -> int:
            return h2h.get(block_hashes[i], 0).bit_count()

        if n == 0 or size(0) == 0:
            return
        lo, hi = 1, n  # size(lo - 1) > 0; the number of held blocks is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if size(mid) > 0:
                lo = mid + 1
            else:
                hi = mid
        deepest = lo
        drops = _find_drops(size, deepest - 1)
        previous = h2h[block_hashes[deepest - 1]]
        yield deepest, previous
        for i in reversed(drops):
            current = h2h[block_hashes[i - 1]]
            yield i, current & ~previous
            previous = current

    def num_blocks(self, url: str) -> int:
        model = self.url_to_model.get(url)
        return len(model) if model is not None else 0

    def check_invariants(self) -> None:
        total = 0
        h2h = self.hash_to_holders
        for url, model in self.url_to_model.items():
            total += len(model)
            slot = self.url_to_slot[url]
            assert self.slot_to_url[slot] == url, "index: slot table"
            assert len(model) <= model.capacity_blocks, f"index: {url} over its capacity"
            for h in model.blocks():
                assert (h2h.get(h, 0) >> slot) & 1, f"index: {url} holds {h} but is not listed"
        assert total == self.num_entries, "index: num_entries != sum of model sizes"
        evictable = sum(len(m) for m in self.url_to_model.values() if m.oldest_seq() is not None)
        assert self.num_entries <= self.max_entries or not evictable, "index: over max_entries"
        assert len(self.slot_to_url) == len(self.url_to_model), "index: slot count"
        capacities = sum(map(_sized, self.url_to_model.values()))
        assert self._capacity_sum == capacities, "index: capacity sum"
        for h, mask in h2h.items():
            assert mask, "index: empty holder set"
            for url in self.urls_of(mask):
                assert self.url_to_model[url].holds(h), f"index: {url} listed without {h}"


def _sized(model: CacheModel) -> int:
    """What ``model`` adds to an index sized to its models."""
    return min(model.nominal_capacity_blocks, MAX_SIZED_BLOCKS)


def _find_drops(size: Callable[[int], int], last: int) -> list[int]:
    """Positions i in (0, last] where the non-increasing ``size`` drops, ascending; bisection."""
    found: list[int] = []
    stack = [(0, last, size(0), size(last))]
    while stack:
        a, b, sa, sb = stack.pop()
        if sa == sb or b <= a:
            continue  # nested sets of equal size are equal: no drop inside
        if b - a == 1:
            found.append(b)
            continue
        m = (a + b) // 2
        sm = size(m)
        stack.append((a, m, sa, sm))
        stack.append((m, b, sm, sb))
    found.sort()
    return found
