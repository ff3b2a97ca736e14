"""Which backend holds which prefix: a global block -> holders map over per-backend cache models.

Each backend has a ``CacheModel``: what the router believes is in that engine's prefix
cache, in engine blocks. Today that is ``LruCacheModel`` (approximate mode: fed by the
router's own dispatches). Exact mode will plug in a model fed by the engine's KV events
through the same ``apply`` path (blocks added, blocks removed).

Blocks are chained keys (core/keys.py): a key determines its whole prefix. Every model
keeps its holdings contiguous (a block is held only if its parent is), so the holders of
block i+1 are a subset of the holders of block i. ``levels`` uses that nesting to find
every holder's match depth with O(distinct depths x log(prompt blocks)) lookups instead
of a walk over the fleet or over every block.
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence


class CacheModel(abc.ABC):
    """One backend's prefix cache as the router models it (blocks, not tokens)."""

    capacity_blocks: int

    @abc.abstractmethod
    def holds(self, block_hash: int) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def blocks(self) -> Iterator[int]:
        """Every held block, in eviction order (next to evict first)."""

    @abc.abstractmethod
    def insert(self, block_hashes: Sequence[int], seq: int) -> tuple[list[int], list[int]]:
        """Touch a request's prefix; returns (positions newly held, blocks evicted)."""

    @abc.abstractmethod
    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Resize; returns the blocks evicted to fit."""

    @abc.abstractmethod
    def oldest_seq(self) -> int | None:
        """Touch sequence number of the next block to evict (None when empty)."""

    @abc.abstractmethod
    def evict_oldest(self) -> int | None:
        """Evict the next block in eviction order; None when empty."""


class LruCacheModel(CacheModel):
    """Capacity-bounded LRU in engine blocks, evicting like vLLM's free-block queue.

    Order invariant: the OrderedDict is in eviction order (front first). A request's
    blocks are touched tail first, so its tail sits ahead of its head and is evicted
    first among blocks of equal recency, as the engine frees a request's blocks in
    reverse. A parent is always touched in the same insert as its children and after
    them, so it never precedes a child in the order: eviction from the front keeps the
    holdings contiguous without any extra bookkeeping.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> touch seq

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self) -> Iterator[int]:
        return iter(self._lru)

    def insert(self, block_hashes: Sequence[int], seq: int) -> tuple[list[int], list[int]]:
        lru = self._lru
        move = lru.move_to_end
        added: list[int] = []
        # A prompt longer than the cache keeps only its head, as the engine would.
        for i in range(min(len(block_hashes), self.capacity_blocks) - 1, -1, -1):
            h = block_hashes[i]
            if h in lru:
                lru[h] = seq
                move(h)
            else:
                lru[h] = seq
                added.append(i)
        return added, self._evict_to(self.capacity_blocks)

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
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
        lru = self._lru
        evicted = []
        while len(lru) > size:
            evicted.append(lru.popitem(last=False)[0])
        return evicted


class PrefixIndex:
    """Global ``hash_to_holders`` over per-backend cache models, with a hard entry cap.

    Invariants (``check_invariants``):
    - a hash lists backend r as a holder exactly when r's cache model holds it; no hash
      maps to an empty set; ``hash_to_parent`` has exactly the keys of ``hash_to_holders``;
    - each backend's holdings are contiguous: a held block's parent is held by it too;
    - the total of all models' sizes equals ``num_entries`` and never exceeds
      ``max_entries`` (enforced on insert by evicting the globally least recently used).
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.hash_to_holders: dict[int, set[str]] = {}
        self.hash_to_parent: dict[int, int | None] = {}  # chain parent (None: first block)
        self.url_to_model: dict[str, CacheModel] = {}
        self.num_entries = 0
        self._seq = 0  # global touch counter (recency across backends)

    def add_backend(self, url: str, model: CacheModel) -> None:
        if url in self.url_to_model:
            raise ValueError(f"backend already indexed: {url}")
        if len(model):
            raise ValueError("add_backend takes an empty cache model")
        self.url_to_model[url] = model

    def remove_backend(self, url: str) -> None:
        """Drop every entry of ``url`` at once (unknown URL: no-op)."""
        model = self.url_to_model.pop(url, None)
        if model is None:
            return
        self.num_entries -= len(model)
        self._drop(url, list(model.blocks()))

    def set_capacity(self, url: str, capacity_blocks: int) -> None:
        model = self.url_to_model[url]
        if model.capacity_blocks != capacity_blocks:
            evicted = model.set_capacity(capacity_blocks)
            self.num_entries -= len(evicted)
            self._drop(url, evicted)

    def insert(self, url: str, block_hashes: Sequence[int]) -> None:
        """Record that ``url`` now caches the prefix ``block_hashes`` (approximate mode)."""
        if not block_hashes:
            return
        self._seq += 1
        added, evicted = self.url_to_model[url].insert(block_hashes, self._seq)
        self.apply(url, [block_hashes[i] for i in added], evicted, block_hashes, added)

    def apply(
        self,
        url: str,
        added: Sequence[int],
        removed: Sequence[int],
        chain: Sequence[int] = (),
        positions: Sequence[int] = (),
    ) -> None:
        """Mirror a model change into the holders map; ``positions`` index ``chain``."""
        h2h = self.hash_to_holders
        h2p = self.hash_to_parent
        for h, i in zip(added, positions, strict=True):
            holders = h2h.get(h)
            if holders is None:
                h2h[h] = {url}
                h2p[h] = chain[i - 1] if i else None
            else:
                holders.add(url)
        self.num_entries += len(added) - len(removed)
        self._drop(url, removed)
        self._enforce_cap()

    def _drop(self, url: str, hashes: Sequence[int]) -> None:
        h2h = self.hash_to_holders
        for h in hashes:
            holders = h2h[h]
            holders.discard(url)
            if not holders:
                del h2h[h]
                del self.hash_to_parent[h]

    def _enforce_cap(self) -> None:
        """Evict globally least-recently-used blocks until under the cap (batch of 1/64)."""
        if self.num_entries <= self.max_entries:
            return
        target = self.max_entries - max(1, self.max_entries // 64)
        heap = [(m.oldest_seq(), u) for u, m in self.url_to_model.items() if len(m)]
        heapq.heapify(heap)
        while self.num_entries > target and heap:
            _, url = heapq.heappop(heap)
            model = self.url_to_model[url]
            h = model.evict_oldest()
            assert h is not None, "index: heap entry of an empty model"
            self.num_entries -= 1
            self._drop(url, (h,))
            seq = model.oldest_seq()
            if seq is not None:
                heapq.heappush(heap, (seq, url))

    def matched_blocks(self, url: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` held by ``url`` (binary search on contiguity)."""
        model = self.url_to_model.get(url)
        if model is None or not block_hashes or not model.holds(block_hashes[0]):
            return 0
        lo, hi = 1, len(block_hashes)  # held(lo - 1) is true; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if model.holds(block_hashes[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def levels(self, block_hashes: Sequence[int]) -> Iterator[tuple[int, set[str]]]:
        """(depth, holders whose match is exactly depth blocks), deepest first, depth > 0."""
        h2h = self.hash_to_holders
        n = len(block_hashes)

        def size(i: int) -> int:
            return len(h2h.get(block_hashes[i], ()))

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
        drops: list[int] = []  # positions i where size(i) < size(i - 1), ascending
        self._find_drops(size, 0, deepest - 1, size(0), size(deepest - 1), drops)
        previous = h2h[block_hashes[deepest - 1]]
        yield deepest, previous
        for i in reversed(drops):
            current = h2h[block_hashes[i - 1]]
            yield i, current - previous
            previous = current

    @staticmethod
    def _find_drops(
        size: Callable[[int], int], lo: int, hi: int, s_lo: int, s_hi: int, out: list[int]
    ) -> None:
        """Positions in (lo, hi] where the (non-increasing) size drops; bisection."""
        stack = [(lo, hi, s_lo, s_hi)]
        found: list[int] = []
        while stack:
            a, b, sa, sb = stack.pop()
            if sa == sb or b <= a:
                continue
            if b - a == 1:
                found.append(b)
                continue
            m = (a + b) // 2
            sm = size(m)
            stack.append((a, m, sa, sm))
            stack.append((m, b, sm, sb))
        out.extend(sorted(found))

    def num_blocks(self, url: str) -> int:
        model = self.url_to_model.get(url)
        return len(model) if model is not None else 0

    def check_invariants(self) -> None:
        total = 0
        for url, model in self.url_to_model.items():
            total += len(model)
            assert len(model) <= model.capacity_blocks, f"index: {url} over its capacity"
            for h in model.blocks():
                assert url in self.hash_to_holders.get(h, ()), f"index: {url} missing as holder"
                parent = self.hash_to_parent[h]
                assert parent is None or model.holds(parent), f"index: {url} not contiguous"
        assert total == self.num_entries, "index: num_entries != sum of model sizes"
        assert self.num_entries <= self.max_entries, "index: over max_entries"
        assert self.hash_to_parent.keys() == self.hash_to_holders.keys(), "index: parent keys"
        for h, holders in self.hash_to_holders.items():
            assert holders, "index: empty holder set"
            for url in holders:
                assert self.url_to_model[url].holds(h), "index: holder without the block"
