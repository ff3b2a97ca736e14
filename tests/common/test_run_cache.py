"""RunCache: block keys a run at a time, remembered, equal to chaining every block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.hashing import ROOT_SEED, RunCache, _chain, token_block_hashes


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.binary(max_size=600),
    tails=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
    step=st.sampled_from([1, 3, 8, 16]),
    run_blocks=st.integers(1, 8),
    max_runs=st.integers(1, 6),
    parent=st.sampled_from([ROOT_SEED, 0, 2**64 - 1]),
)
def test_keys_equal_chaining_every_block(prefix, tails, step, run_blocks, max_runs, parent):
    cache = RunCache(run_blocks=run_blocks, max_runs=max_runs)
    for tail in tails:  # prompts sharing a prefix: later ones hit runs of earlier ones
        data = prefix + tail
        assert cache.chain(data, step, parent) == _chain(data, step, parent)
        assert len(cache) <= max(2, max_runs)


def test_a_shared_prefix_is_chained_once() -> None:
    cache = RunCache(run_blocks=4, max_runs=100)
    system = bytes(range(256)) * 8  # 2,048 bytes: 32 runs of 4 x 16-byte blocks
    cache.chain(system + b"first question", 16, ROOT_SEED)
    runs = set(cache._current) | set(cache._previous)
    keys = cache.chain(system + b"second question!", 16, ROOT_SEED)
    assert set(cache._current) | set(cache._previous) == runs  # every run was a hit
    assert keys == _chain(system + b"second question!", 16, ROOT_SEED)


def test_token_keys_take_lists_and_arrays_alike() -> None:
    from array import array

    ids = list(range(5_000))
    assert token_block_hashes(ids, 16) == token_block_hashes(array("Q", ids), 16)
