"""A hashed prompt given as its block hashes and its tail (``HashedPrompt``) runs exactly
as the whole prompt does: the same outputs, timings, caches and counters, on random
batches with shared prefixes and tight caches (preemption and recompute included); its
hashed ids cannot be read, and an engine that would need them refuses it."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.engine import Engine
from kvroute.engine.request import HashedPrompt

from .helpers import make_profile, run_to_completion


def _run(prompts: list[list[int]], bs: int, num_blocks: int, hashed: bool) -> tuple:
    profile = make_profile(
        block_size=bs, kv_capacity_tokens=num_blocks * bs, max_model_len=num_blocks * bs
    )
    engine = Engine(profile)
    for i, ids in enumerate(prompts):
        hashes = token_block_hashes(ids, bs, ROOT_SEED)
        given = HashedPrompt.of(array("Q", ids), bs) if hashed else ids
        engine.add_request(f"r{i}", given, 3 + i % 5, block_hashes=hashes)
    elapsed, outputs = run_to_completion(engine)
    tokens = {
        rid: [(o.token_id, o.num_cached_tokens) for o in outs] for rid, outs in outputs.items()
    }
    return elapsed, tokens, engine.stats


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), min_size=1, max_size=12),
    bs=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(12, 60),
)
def test_a_hashed_prompt_runs_as_the_whole_prompt(
    shapes: list[tuple[int, int]], bs: int, num_blocks: int
) -> None:
    # prompts on three shared heads, each cut to a length that fits the context
    limit = num_blocks * bs - 8
    prompts = [[1000 * head + t for t in range(min(n * 3, limit))] for head, n in shapes]
    assert _run(prompts, bs, num_blocks, hashed=True) == _run(prompts, bs, num_blocks, hashed=False)


def test_the_hashed_ids_are_not_kept() -> None:
    prompt = HashedPrompt.of(list(range(10)), 4)
    assert len(prompt) == 10 and prompt[8:10] == [8, 9] and prompt[9:] == [9]
    prompt.append(10)
    assert len(prompt) == 11 and prompt[8:12] == [8, 9, 10]
    with pytest.raises(IndexError, match="hashed"):
        prompt[4:8]
    assert HashedPrompt.of(list(range(8)), 4)[8:8] == []  # nothing past the blocks


def test_an_engine_that_needs_the_ids_refuses_a_hashed_prompt() -> None:
    ids = list(range(40))
    hashes = token_block_hashes(ids, 16, ROOT_SEED)
    with pytest.raises(ValueError, match="HashedPrompt"):
        Engine(make_profile()).add_request("a", HashedPrompt.of(ids, 16), 2)  # no hashes
    with pytest.raises(ValueError, match="HashedPrompt"):  # KV events carry every id
        Engine(make_profile(), enable_kv_events=True).add_request(
            "b", HashedPrompt.of(ids, 16), 2, block_hashes=hashes
        )
