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

The log keeps 8 bytes per prompt block (``array``), so it grows with the run. One sort
of the hashes (numpy) gives each block's previous and next use, and the three hit counts
are array operations over those (a Python step per prompt for the LRU); the LRU and
Belady caches are walked block by block only where that shortcut does not hold (a block
twice in one prompt; a Belady cache that fills up). tests/des/test_ceilings.py checks
the counts against the walks.
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
    walk = _Walk.of(log)  # one sort of the log for the three
    return Ceilings(
        infinite_hits(log, walk) * bs / total,
        pooled_lru_hits(log, capacity_blocks, walk) * bs / total,
        belady_hits(log, capacity_blocks, walk) * bs / total,
        capacity_blocks,
    )


def _neighbours(hashes: array[int]) -> tuple[np.ndarray, np.ndarray]:
    """(previous, next) position of each block's hash in the log, -1 / len when none:
    one sort instead of a dict of every block ever sent.

    The sort is of one 64-bit key per block: the hash's high bits, then the block's
    position in the low bits the positions need, so the sorted keys give the order too,
    and blocks whose hashes share the high bits come out in log order. Neighbours with
    equal hashes are linked; the rare group whose high bits are shared by different
    hashes is linked again by its full hashes."""
    h = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros(0, np.uint64)
    n = h.size
    bits = max(1, n.bit_length())
    low = np.uint64((1 << bits) - 1)
    # in place where it can be: on a million-request run each array is 600 MB, and these
    # are the simulator's peak memory
    keys = np.arange(n, dtype=np.uint64)
    keys |= h & ~low
    keys.sort()
    order = (keys & low).view(np.int64)  # positions < 2**63: the same bits
    keys >>= np.uint64(bits)
    group = keys  # in place: now each sorted block's high hash bits
    del keys
    same_group = group[1:] == group[:-1]
    sorted_hashes = h[order]
    same = sorted_hashes[1:] == sorted_hashes[:-1]
    del sorted_hashes
    link = same_group & same
    mixed = same_group & ~same
    del same, same_group
    if not mixed.any():
        del group  # needed only to link the mixed groups again
    # each position once in each: its sorted neighbour where linked, else none
    prev = np.empty(n, dtype=np.int64)
    nxt = np.empty(n, dtype=np.int64)
    if n:
        prev[order[0]], nxt[order[-1]] = -1, n
        prev[order[1:]] = np.where(link, order[:-1], -1)
        nxt[order[:-1]] = np.where(link, order[1:], n)
    del link
    if mixed.any():  # the groups are runs of the sorted keys
        runs = np.unique(group[1:][mixed])
        first = np.searchsorted(group, runs, "left")
        end = np.searchsorted(group, runs, "right")
        shared = np.concatenate([order[a:b] for a, b in zip(first, end, strict=True)])
        prev[shared], nxt[shared] = -1, n
        last: dict[int, int] = {}
        for i in np.sort(shared).tolist():
            j = last.get(hashes[i])
            if j is not None:
                prev[i], nxt[j] = j, i
            last[hashes[i]] = i
    return prev, nxt


@dataclass(frozen=True, slots=True)
class _Walk:
    """The log as arrays: each block's previous and next use, each prompt's bounds."""

    prev: np.ndarray  # per block: position of the hash's previous use, -1 when none
    nxt: np.ndarray  # per block: position of its next use, len when none
    starts: np.ndarray  # per prompt: its first block
    sizes: np.ndarray  # per prompt: its blocks
    usable: np.ndarray  # per prompt: blocks a hit may cover
    counted: np.ndarray  # per prompt: measured (bool)

    @classmethod
    def of(cls, log: PromptLog) -> _Walk:
        prev, nxt = _neighbours(log.hashes)
        ends = np.array(log.ends, dtype=np.int64)
        starts = np.zeros_like(ends)
        starts[1:] = ends[:-1]
        usable = np.array(log.usable, dtype=np.int64)
        counted = np.array(log.counted, dtype=bool)
        return cls(prev, nxt, starts, ends - starts, usable, counted)

    def leading_runs(self, ok: np.ndarray) -> int:
        """Counted blocks of the prompts' leading runs of ``ok`` blocks (at most the
        usable ones each): the prefix hits of a cache that holds the ``ok`` ones."""
        bad = np.append(np.flatnonzero(~ok), ok.size)
        first_bad = bad[np.searchsorted(bad, self.starts)]
        runs = np.minimum(first_bad - self.starts, self.usable)
        return int(runs[self.counted].sum())


def infinite_hits(log: PromptLog, walk: _Walk | None = None) -> int:
    """Counted hit blocks of an unbounded prefix cache: the leading blocks sent before."""
    walk = walk or _Walk.of(log)
    return walk.leading_runs(walk.prev >= 0)


def pooled_lru_hits(log: PromptLog, capacity: int, walk: _Walk | None = None) -> int:
    """Counted prefix-hit blocks of one LRU cache of ``capacity`` blocks.

    The cache is looked up before a prompt and trimmed to ``capacity`` after it is put
    in, so at a prompt's lookup it holds the ``capacity`` blocks used last; a block whose
    previous use is at ``l`` is held when at most ``capacity`` distinct blocks were used
    at ``l`` or later, i.e. when ``l`` is at least the prompt's threshold
    (``_lru_thresholds``). A log with a block twice in one prompt is walked block by
    block instead (``_pooled_lru_hits_walked``)."""
    if capacity < 1:
        return 0
    walk = walk or _Walk.of(log)
    if np.any(walk.prev >= np.repeat(walk.starts, walk.sizes)):  # within one prompt
        return _pooled_lru_hits_walked(log, capacity)
    thresholds = _lru_thresholds(walk, capacity)
    return walk.leading_runs(walk.prev >= np.repeat(thresholds, walk.sizes))


def _lru_thresholds(walk: _Walk, capacity: int) -> np.ndarray:
    """Per prompt, at its start ``t``: the least ``x`` such that at most ``capacity`` of
    the positions in ``[x, t)`` are their hash's last use before ``t`` (live). ``x`` only
    moves forward (a block used again is live again, later), so one sweep finds them."""
    nxt, prev = walk.nxt, walk.prev
    out = np.zeros(walk.starts.size, dtype=np.int64)
    x = live = last = 0
    for p, t in enumerate(walk.starts.tolist()):
        if t > last:  # the previous prompt's blocks are in: live, and the uses they end
            live += int(np.count_nonzero(nxt[last:t] >= t))
            before = prev[last:t]
            live -= int(np.count_nonzero((before >= x) & (before < last)))
            last = t
        drop = live - capacity
        while drop > 0:  # move x past the ``drop`` oldest live positions
            step = max(drop * 2, 4096)
            alive = np.cumsum(nxt[x : min(t, x + step)] >= t)
            if alive.size and alive[-1] >= drop:
                x += int(np.searchsorted(alive, drop)) + 1
                live -= drop
                break
            x += alive.size
            got = int(alive[-1]) if alive.size else 0
            live -= got
            drop -= got
        out[p] = x
    return out


def _pooled_lru_hits_walked(log: PromptLog, capacity: int) -> int:
    """``pooled_lru_hits`` by an ``OrderedDict`` walked block by block."""
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


def belady_hits(log: PromptLog, capacity: int, walk: _Walk | None = None) -> int:
    """Counted block hits (within each prompt's usable blocks) of one cache of
    ``capacity`` blocks under Belady's replacement with bypass.

    The cache holds, before each block, the blocks used before and again at or after it.
    While that never reaches ``capacity`` when a new block comes that is used again,
    nothing is ever evicted or bypassed, and the hits are the blocks used before: counted
    at once. Otherwise the cache is walked block by block (``_belady_hits_walked``)."""
    if capacity < 1:
        return 0
    walk = walk or _Walk.of(log)
    if _belady_evicts(walk, capacity):
        return _belady_hits_walked(log, capacity, walk.nxt)
    # every block used before is a hit: counted per prompt from a running count
    seen = np.zeros(walk.prev.size + 1, dtype=np.int64)
    np.cumsum(walk.prev >= 0, out=seen[1:])
    ends = walk.starts + np.minimum(walk.usable, walk.sizes)
    return int((seen[ends] - seen[walk.starts])[walk.counted].sum())


def _belady_evicts(walk: _Walk, capacity: int) -> bool:
    """Whether the cache ever holds ``capacity`` blocks used again when a new block comes
    that is used again (the walk must then choose what to keep). Its arrays go on return:
    on a million-request run each is 500 MB."""
    prev, nxt = walk.prev, walk.nxt
    n = prev.size
    again = nxt < n
    # a block used again is held from just after it to its next use, inclusive
    held = np.bincount(np.flatnonzero(again) + 1, minlength=n + 2)
    held -= np.bincount(nxt[again] + 1, minlength=n + 2)
    np.cumsum(held, out=held)
    return bool(np.any(held[:n][(prev < 0) & again] >= capacity))


def _belady_hits_walked(log: PromptLog, capacity: int, next_uses: np.ndarray) -> int:
    """``belady_hits`` by a dict of the cached blocks and a heap of their next uses."""
    hashes = log.hashes
    n = len(hashes)
    never = n  # "not used again"
    cached: dict[int, int] = {}  # hash -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, hash); stale entries skipped, pruned
    hits = 0
    for start, end, usable, _, counted in log.prompts():
        # a prompt's next uses at a time: the whole list is 36 bytes a block of the log
        for i, nxt in enumerate(next_uses[start:end].tolist(), start):
            h = hashes[i]
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
