"""The three ceilings on hand-made prompt logs, and their order on random ones."""

from __future__ import annotations

import random
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.des.ceilings import (
    PromptLog,
    _belady_hits_walked,
    _neighbours,
    _pooled_lru_hits_walked,
    belady_hits,
    ceilings,
    infinite_hits,
    pooled_lru_hits,
)


def log_of(prompts: list[list[int]], bs: int = 1) -> PromptLog:
    """Prompts as lists of block ids; each block one token, plus one (so all are usable)."""
    log = PromptLog(bs)
    for blocks in prompts:
        log.add(blocks, len(blocks) * bs + 1, counted=True)
    return log


def test_infinite_counts_the_longest_prefix_seen() -> None:
    log = log_of([[1, 2, 3], [1, 2, 4], [5, 2, 3]])
    assert infinite_hits(log) == 2  # [1, 2] once; [5, ...] starts a new chain


def test_lru_forgets_and_belady_keeps_what_comes_back() -> None:
    # capacity 2: A A B C A. LRU: A (hit), then B and C push A out: 1 hit.
    # Belady keeps A (used again) and bypasses B and C: 2 hits.
    log = log_of([[1], [1], [2], [3], [1]])
    assert pooled_lru_hits(log, 2) == 1
    assert belady_hits(log, 2) == 2
    assert infinite_hits(log) == 2


def test_warm_up_fills_the_cache_but_is_not_counted() -> None:
    log = PromptLog(1)
    log.add([1, 2], 3, counted=False)
    log.add([1, 2], 3, counted=True)
    c = ceilings(log, 10)
    assert c.infinite == c.pooled_lru == c.belady == 2 / 3


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), max_size=30),
    capacity=st.integers(0, 12),
)
def test_lru_le_belady_le_infinite(prompts: list[list[int]], capacity: int) -> None:
    # chain the ids as a prefix cache would: a block is its whole prefix
    chained = [[hash(tuple(p[: i + 1])) & 0xFFFF_FFFF for i in range(len(p))] for p in prompts]
    log = log_of(chained)
    lru, opt = pooled_lru_hits(log, capacity), belady_hits(log, capacity)
    assert lru <= opt <= infinite_hits(log)  # a chained block hit implies its prefix was seen
    assert opt <= sum(len(p) for p in prompts)


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=5), max_size=25))
def test_infinite_equals_a_set_of_everything_seen(prompts: list[list[int]]) -> None:
    chained = [[hash(tuple(p[: i + 1])) & 0xFFFF_FFFF for i in range(len(p))] for p in prompts]
    seen: set[int] = set()
    want = 0
    for blocks in chained:
        matched = 0
        while matched < len(blocks) and blocks[matched] in seen:
            matched += 1
        want += matched
        seen.update(blocks)
    assert infinite_hits(log_of(chained)) == want


def _walked_neighbours(hashes: list[int]) -> tuple[list[int], list[int]]:
    prev, nxt, last = [-1] * len(hashes), [len(hashes)] * len(hashes), {}
    for i, h in enumerate(hashes):
        if h in last:
            prev[i], nxt[last[h]] = last[h], i
        last[h] = i
    return prev, nxt


# hashes that often share their high bits (the sort's key) while differing below
hashes_64 = st.tuples(st.integers(0, 3), st.integers(0, 5)).map(lambda t: t[0] << 62 | t[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(hashes_64, max_size=40))
def test_neighbours_link_each_hash_to_its_previous_and_next_use(hashes: list[int]) -> None:
    prev, nxt = _neighbours(array("Q", hashes))
    assert (prev.tolist(), nxt.tolist()) == _walked_neighbours(hashes)


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.lists(st.integers(0, 12), max_size=6), st.integers(0, 3), st.booleans()),
        max_size=30,
    ),
    capacity=st.integers(0, 14),
    chained=st.booleans(),
)
def test_counted_at_once_equals_walked_block_by_block(
    prompts: list[tuple[list[int], int, bool]], capacity: int, chained: bool
) -> None:
    """The vectorized LRU and Belady (and their shortcuts) equal the walks, with warm-up
    prompts, partial tail blocks and blocks repeated within a prompt."""
    log = PromptLog(4)
    for blocks, tail, counted in prompts:
        if chained:
            blocks = [hash(tuple(blocks[: i + 1])) & 0xFFFF for i in range(len(blocks))]
        log.add(blocks, len(blocks) * 4 + tail, counted=counted)
    assert pooled_lru_hits(log, capacity) == _pooled_lru_hits_walked(log, capacity)
    assert belady_hits(log, capacity) == _belady_hits_walked(
        log, capacity, _neighbours(log.hashes)[1]
    )


def test_counted_at_once_equals_walked_on_a_long_log() -> None:
    """Thousands of prompts: the LRU sweep steps over long runs of dead positions."""
    rng = random.Random(5)
    log = PromptLog(2)
    for _ in range(3000):
        head = rng.choice([rng.randrange(40), rng.randrange(10_000)])  # hot and cold prefixes
        blocks = [head * 100 + i for i in range(rng.randrange(1, 25))]
        log.add(blocks, len(blocks) * 2 + rng.randrange(2), counted=rng.random() < 0.9)
    for capacity in (1, 30, 300, 3000, 100_000):
        assert pooled_lru_hits(log, capacity) == _pooled_lru_hits_walked(log, capacity)
        want = _belady_hits_walked(log, capacity, _neighbours(log.hashes)[1])
        assert belady_hits(log, capacity) == want
