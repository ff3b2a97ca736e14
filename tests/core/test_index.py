"""The prefix index and its LRU cache model: small exact stories plus a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.core.index import MAX_SIZED_BLOCKS, LruCacheModel, PrefixIndex


def make_index(capacities: dict[str, int], max_entries: int = 10_000) -> PrefixIndex:
    index = PrefixIndex(max_entries)
    for url, cap in capacities.items():
        index.add_backend(url, LruCacheModel(cap))
    return index


def held(index: PrefixIndex, url: str) -> list[int]:
    """Blocks of ``url`` in eviction order (next to evict first)."""
    return list(index.url_to_model[url].blocks())


def test_lru_evicts_tail_first_then_least_recent():
    # Capacity 4. Request A = [1, 2, 3]; request B = [1, 4]: block 1 shared.
    index = make_index({"r": 4})
    index.insert("r", [1, 2, 3])
    assert held(index, "r") == [3, 2, 1]  # tail first among equal recency
    index.insert("r", [1, 4])
    assert held(index, "r") == [3, 2, 4, 1]  # 1 re-touched, after its new child 4
    index.insert("r", [5, 6])  # two new blocks evict A's tail 3, then 2
    assert held(index, "r") == [4, 1, 6, 5]
    assert index.holders(3) == set() and index.holders(2) == set()
    assert index.holders(1) == {"r"}
    index.check_invariants()


def test_holdings_stay_contiguous_and_match_walks_from_the_first_block():
    index = make_index({"r": 3})
    index.insert("r", [1, 2, 3])
    index.insert("r", [9])  # evicts 3 (the tail), never the head
    assert index.matched_blocks("r", [1, 2, 3]) == 2
    assert index.matched_blocks("r", [7, 2, 3]) == 0  # a match starts at the first block
    index.check_invariants()


def test_prompt_longer_than_the_cache_keeps_its_head():
    index = make_index({"r": 2})
    index.insert("r", [1, 2, 3, 4])
    assert held(index, "r") == [2, 1]
    index.check_invariants()


@pytest.mark.parametrize(
    ("name", "inserts", "prompt", "expected"),
    [
        ("nobody", {}, [1, 2, 3], []),
        ("one full", {"a": [1, 2, 3]}, [1, 2, 3], [(3, {"a"})]),
        ("two depths", {"a": [1, 2, 3], "b": [1, 2]}, [1, 2, 3, 4], [(3, {"a"}), (2, {"b"})]),
        ("same depth", {"a": [1, 2], "b": [1, 2]}, [1, 2, 7], [(2, {"a", "b"})]),
        (
            "three levels",
            {"a": [1], "b": [1, 2, 3, 4, 5], "c": [1, 2, 3]},
            [1, 2, 3, 4, 5, 6],
            [(5, {"b"}), (3, {"c"}), (1, {"a"})],
        ),
        ("diverged", {"a": [1, 2], "b": [1, 8]}, [1, 2], [(2, {"a"}), (1, {"b"})]),
    ],
)
def test_levels_give_each_holder_its_depth(name, inserts, prompt, expected):
    index = make_index({u: 100 for u in "abc"})
    for url, blocks in inserts.items():
        index.insert(url, blocks)
    got = [(depth, set(index.urls_of(mask))) for depth, mask in index.levels(prompt)]
    assert got == expected, name
    for depth, urls in expected:
        for url in urls:
            assert index.matched_blocks(url, prompt) == depth


def test_remove_backend_vanishes_from_the_index_at_once():
    index = make_index({"a": 10, "b": 10})
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.remove_backend("a")
    assert index.holders(1) == {"b"} and index.holders(3) == set()
    assert 3 not in index.hash_to_holders and index.num_entries == 2
    index.check_invariants()
    index.add_backend("c", LruCacheModel(10))  # reuses a's slot with no stale bits
    assert index.holders(1) == {"b"}
    index.check_invariants()


def test_global_cap_holds_and_evicts_the_oldest_first():
    index = make_index({"a": 100, "b": 100}, max_entries=64)
    for i in range(40):
        url = "a" if i % 2 else "b"
        index.insert(url, [1000 + i * 10 + j for j in range(3)])
        assert index.num_entries <= 64
        index.check_invariants()
    assert index.holders(1000) == set()  # the first request's blocks went first
    assert index.holders(1000 + 39 * 10) == {"a"}  # the last stays


def test_set_capacity_shrinks_the_model():
    index = make_index({"a": 10})
    index.insert("a", [1, 2, 3, 4])
    index.set_capacity("a", 2)
    assert held(index, "a") == [2, 1]
    index.check_invariants()


def test_an_index_sized_to_its_models_follows_them_and_keeps_every_cache_full():
    index = PrefixIndex(None)
    for url, cap in (("a", 4), ("b", 5), ("c", 6)):
        index.add_backend(url, LruCacheModel(cap))
    assert index.max_entries == 15
    for url in ("a", "b", "c"):
        index.insert(url, [ord(url) * 100 + i for i in range(10)])  # more than any holds
    assert [index.num_blocks(u) for u in ("a", "b", "c")] == [4, 5, 6]  # nothing capped
    index.set_capacity("c", 2)
    assert index.max_entries == 11 and index.num_blocks("c") == 2
    index.remove_backend("a")
    assert index.max_entries == 7
    index.check_invariants()
    index.add_backend("z", LruCacheModel(1 << 60))  # an absurd gauge counts as the most
    assert index.max_entries == 7 + MAX_SIZED_BLOCKS
    fixed = make_index({"a": 4, "b": 5, "c": 6}, max_entries=10)  # a hard cap cuts them
    for url in ("a", "b", "c"):
        fixed.insert(url, [ord(url) * 100 + i for i in range(10)])
    assert sum(fixed.num_blocks(u) for u in ("a", "b", "c")) <= 10
    fixed.check_invariants()


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="capacity_blocks"):
        LruCacheModel(0)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(0)


# Chains: prompt p, length L -> keys (p, 0..L-1) encoded as ints; parent of (p, i) is (p, i-1).
# Prompts share prefixes by sharing the family "p // 3" for their first two blocks.
def keys_of(prompt: int, length: int) -> list[int]:
    family = prompt // 3
    return [family * 1000 + i if i < 2 else prompt * 1000 + 100 + i for i in range(length)]


def parent_of(key: int) -> int | None:
    base, i = divmod(key, 1000)
    if i == 0:
        return None
    if i == 102:  # first private block: parent is the family's second block
        return (base // 3) * 1000 + 1
    return key - 1


class IndexMachine(RuleBasedStateMachine):
    """Random inserts, capacity changes and removals; every invariant after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(max_entries=40)
        self.next_url = 0

    @rule(capacity=st.integers(1, 12))
    def add(self, capacity):
        if len(self.index.url_to_model) < 5:
            self.index.add_backend(f"u{self.next_url}", LruCacheModel(capacity))
            self.next_url += 1

    @rule(pick=st.integers(0, 100), prompt=st.integers(0, 11), length=st.integers(1, 8))
    def insert(self, pick, prompt, length):
        urls = sorted(self.index.url_to_model)
        if urls:
            self.index.insert(urls[pick % len(urls)], keys_of(prompt, length))

    @rule(pick=st.integers(0, 100), capacity=st.integers(1, 12))
    def resize(self, pick, capacity):
        urls = sorted(self.index.url_to_model)
        if urls:
            self.index.set_capacity(urls[pick % len(urls)], capacity)

    @rule(pick=st.integers(0, 100))
    def remove(self, pick):
        urls = sorted(self.index.url_to_model)
        if urls:
            self.index.remove_backend(urls[pick % len(urls)])

    @invariant()
    def consistent(self):
        self.index.check_invariants()
        for url, model in self.index.url_to_model.items():
            for h in model.blocks():  # contiguity: a held block's parent is held
                parent = parent_of(h)
                assert parent is None or model.holds(parent), f"{url} not contiguous"

    @invariant()
    def levels_agree_with_matched_blocks(self):
        for prompt in (0, 1, 4):
            keys = keys_of(prompt, 8)
            depths = {}
            for depth, mask in self.index.levels(keys):
                for url in self.index.urls_of(mask):
                    depths[url] = depth
            for url in self.index.url_to_model:
                assert depths.get(url, 0) == self.index.matched_blocks(url, keys)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class SizedIndexMachine(IndexMachine):
    """The same steps on an index sized to its models: its cap never cuts a model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(max_entries=None)

    @invariant()
    def sized_to_the_models(self):
        models = self.index.url_to_model.values()
        assert self.index.max_entries == max(1, sum(m.capacity_blocks for m in models))


TestSizedIndexMachine = SizedIndexMachine.TestCase
TestSizedIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
