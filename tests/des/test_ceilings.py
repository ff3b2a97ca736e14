"""The three ceilings on hand-made prompt logs, and their order on random ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.des.ceilings import PromptLog, belady_hits, ceilings, infinite_hits, pooled_lru_hits


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
