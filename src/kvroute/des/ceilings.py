"""What any router could get on this fleet: three ceilings over the prompts a run sent.

Every prompt is logged in send order as its chained block hashes (the engines' blocks),
warm-up ones marked as not counted. Over that log:

- ``infinite``: an unbounded prefix cache (the same figure as bench/ceiling.py: the
  longest prefix an earlier prompt computed, whole blocks, at most ``prompt - 1`` tokens);
- ``pooled_lru``: one cache as big as the whole fleet's KV memory, least recently used
  blocks evicted first, prefix hits as an engine counts them: what a perfect router would
  get if the fleet were one engine;
- ``belady``: the same pooled capacity under Belady's optimal replacement (it knows the
  future: evict the block used again farthest ahead, never keep one that is not used
  again), hits counted per block. No placement on this fleet can keep more useful blocks,
  and a prefix hit is a run of block hits, so it bounds every router's hit rate from above.

The log keeps 8 bytes per prompt block (``array``), so it grows with the run; the passes
find each block's previous and next use with one sort of the hashes (numpy), and the
LRU and Belady caches hold at most the pooled capacity.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


class PromptLog:
    """The block hashes of every sent prompt, in send order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hashes = array("Q")  # every prompt's full blocks, one after the other
        self.ends = array("q")  # where each prompt's blocks end in ``hashes``
        self.usable = array("q")  # blocks a hit may cover: (tokens - 1) // block_size
        self.tokens = array("q")  # prompt tokens
        self.counted = bytearray()  # 1: measured, 0: warm-up

    def add(self, block_hashes: Sequence[int], num_tokens: int, *, counted: bool) -> None:
        self.hashes.extend(block_hashes)
        self.ends.append(len(self.hashes))
        self.usable.append(max(0, (num_tokens - 1) // self.block_size))
        self.tokens.append(num_tokens)
        self.counted.append(counted)

    def __len__(self) -> int:
        return len(self.ends)

    def prompts(self) -> Iterator[tuple[int, int, int, int, bool]]:
        """(start, end, usable blocks, tokens, counted) per prompt."""
        start = 0
        for i, end in enumerate(self.ends):
            yield start, end, self.usable[i], self.tokens[i], bool(self.counted[i])
            start = end

    def counted_tokens(self) -> int:
        return sum(t for t, c in zip(self.tokens, self.counted, strict=True) if c)


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Hit rates (0..1) of the three ceilings; None when nothing was counted."""

    infinite: float | None
    pooled_lru: float | None
    belady: float | None
    capacity_blocks: int  # the pooled cache: the fleet's KV blocks

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "cache_ceiling_hit_rate": self.infinite,
            "pooled_lru_hit_rate": self.pooled_lru,
            "belady_hit_rate": self.belady,
            "pooled_capacity_blocks": self.capacity_blocks,
        }


def ceilings(log: PromptLog, capacity_blocks: int) -> Ceilings:
    total = log.counted_tokens()
    if not total:
        return Ceilings(None, None, None, capacity_blocks)
    bs = log.block_size
    return Ceilings(
        infinite_hits(log) * bs / total,
        pooled_lru_hits(log, capacity_blocks) * bs / total,
        belady_hits(log, capacity_blocks) * bs / total,
        capacity_blocks,
    )


def _neighbours(hashes: array) -> tuple[np.ndarray, np.ndarray]:
    """(previous, next) position of each block's hash in the log, -1 / len when none:
    one stable sort of the hashes instead of a dict of every block ever sent."""
    h = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros(0, np.uint64)
    n = h.size
    order = np.argsort(h, kind="stable")  # equal hashes stay in log order
    same = h[order[1:]] == h[order[:-1]]
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, n, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt


def infinite_hits(log: PromptLog) -> int:
    """Counted hit blocks of an unbounded prefix cache: the leading blocks sent before."""
    seen_before = _neighbours(log.hashes)[0] >= 0
    hits = 0
    for start, _, usable, _, counted in log.prompts():
        if not counted:
            continue
        matched = 0
        while matched < usable and seen_before[start + matched]:
            matched += 1
        hits += matched
    return hits


def pooled_lru_hits(log: PromptLog, capacity: int) -> int:
    """Counted prefix-hit blocks of one LRU cache of ``capacity`` blocks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    hashes = log.hashes
    for start, end, usable, _, counted in log.prompts():
        matched = 0
        while matched < usable and hashes[start + matched] in cache:
            matched += 1
        if counted:
            hits += matched
        for h in hashes[start:end]:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def belady_hits(log: PromptLog, capacity: int) -> int:
    """Counted block hits (within each prompt's usable blocks) of one cache of
    ``capacity`` blocks under Belady's replacement with bypass."""
    hashes = log.hashes
    n = len(hashes)
    never = n  # "not used again"
    next_use = _neighbours(hashes)[1].tolist()
    cached: dict[int, int] = {}  # hash -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, hash); stale entries skipped, pruned
    hits = 0
    for start, end, usable, _, counted in log.prompts():
        for i in range(start, end):
            h = hashes[i]
            nxt = next_use[i]
            if h in cached:
                if counted and i - start < usable:
                    hits += 1
            elif nxt == never or capacity < 1:
                continue  # bypass: never used again
            elif len(cached) >= capacity:
                while True:  # the cached block used farthest ahead
                    neg, victim = heap[0]
                    if cached.get(victim) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= nxt:
                    continue  # every cached block is needed sooner: bypass
                heapq.heappop(heap)
                del cached[victim]
            if nxt == never:
                cached.pop(h, None)
                continue
            cached[h] = nxt
            heapq.heappush(heap, (-nxt, h))
            if len(heap) > 2 * capacity + 1024:  # drop the stale entries
                heap = [(-u, k) for k, u in cached.items()]
                heapq.heapify(heap)
    return hits
