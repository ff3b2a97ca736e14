"""Decode fast-forward equals stepping: ``decode_span`` + ``advance_decodes`` leave an
engine exactly as the same number of ``step()`` calls would, and the spans' durations
are the steps' durations, on random batches (shared prefixes, tight caches, preemption
bounds, requests near their length)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.engine import Engine
from kvroute.engine.fast_forward import (
    advance_decodes,
    decode_batch,
    decode_span,
    stats_after,
)
from kvroute.engine.step_time import StepTimeModel, StepWork

from .helpers import make_profile


def _state(engine: Engine) -> tuple:
    """Everything a step can change, comparable."""
    bm, s = engine.block_manager, engine.scheduler
    reqs = tuple(
        (r.request_id, tuple(r.token_ids), r.num_computed_tokens, tuple(r.block_table),
         tuple(r.block_hashes), r.num_cached_blocks, r.status)
        for r in [*s.running, *s.waiting]
    )  # fmt: skip
    blocks = tuple((b.ref_cnt, b.block_hash) for b in bm.blocks)
    return reqs, blocks, tuple(bm.free_block_ids()), engine.stats


def _engine(prompts: list[tuple[int, int, int]], num_blocks: int, bs: int) -> Engine:
    profile = make_profile(
        block_size=bs,
        kv_capacity_tokens=num_blocks * bs,
        max_model_len=num_blocks * bs,
        t_fwd0_ms=3.0,
        k_ctx_ms_per_token=0.01,
        per_seq_ms=0.5,
    )
    engine = Engine(profile)
    for i, (family, length, max_tokens) in enumerate(prompts):
        ids = [family * 1000 + t for t in range(length)]
        engine.add_request(f"r{i}", ids, max_tokens)
    return engine


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 60)),
        min_size=1,
        max_size=6,
    ),
    num_blocks=st.integers(30, 80),
    bs=st.sampled_from([2, 4, 16]),
    warm_steps=st.integers(0, 6),
    want=st.integers(1, 50),
)
def test_fast_forward_equals_stepping(
    prompts: list[tuple[int, int, int]], num_blocks: int, bs: int, warm_steps: int, want: int
) -> None:
    try:
        a = _engine(prompts, num_blocks, bs)
        b = _engine(prompts, num_blocks, bs)
    except ValueError:
        return  # a request that can never fit this cache
    for _ in range(warm_steps + 1):  # prefill; then perhaps some decodes
        a.step()
        b.step()
    durations, taken = decode_span(a, want)
    assert len(taken) == len(durations) <= want
    if not durations:
        assert decode_batch(a) == 0 or want < 1 or _some_request_ends_or_blocks_run_out(a)
        return
    stepped = []
    for k in range(len(durations)):  # the stats k steps in, read without stepping
        stepped.append(b.step())
        assert stats_after(a, taken[k]) == b.stats
    advance_decodes(a, len(durations))
    assert [r.duration_s for r in stepped] == durations
    assert all(r.num_prefill_tokens == 0 and not any(o.finish_reason for o in r.outputs)
               for r in stepped)  # fmt: skip
    assert _state(a) == _state(b)
    a.check_invariants()


def _some_request_ends_or_blocks_run_out(engine: Engine) -> bool:
    """Why a decode-only engine may not fast-forward even one step."""
    running = engine.scheduler.running
    ends = any(r.max_tokens - (len(r.token_ids) - r.num_prompt_tokens) <= 1 for r in running)
    return ends or engine.block_manager.num_free_blocks < len(running)


def test_not_decode_only_is_not_fast_forwarded() -> None:
    engine = _engine([(0, 30, 20), (1, 30, 20)], 60, 4)
    assert decode_span(engine, 10) == ([], [])  # both still waiting
    engine.step()
    assert decode_batch(engine) == 2
    engine.add_request("late", [7] * 10, 5)
    assert decode_span(engine, 10) == ([], [])  # a waiting request: the next step admits it


def test_jittered_engines_are_not_fast_forwarded() -> None:
    import random

    engine = Engine(make_profile(), rng=random.Random(1), jitter=0.1)
    engine.add_request("a", list(range(20)), 30)
    engine.step()
    assert decode_batch(engine) == 0


@settings(max_examples=200, deadline=None)
@given(
    terms=st.tuples(*[st.floats(0.0, 50.0, allow_subnormal=False)] * 5),
    ctx=st.integers(1, 10**7),
    num_seqs=st.integers(1, 1024),
    num_steps=st.integers(0, 130),
)
def test_decode_durations_are_the_steps_durations_bit_for_bit(
    terms: tuple[float, ...], ctx: int, num_seqs: int, num_steps: int
) -> None:
    t0, b, c, k, s = terms
    model = StepTimeModel(
        make_profile(t_fwd0_ms=t0, b_ms_per_token=b, c_ms_per_pair=c, k_ctx_ms_per_token=k,
                     per_seq_ms=s)
    )  # fmt: skip
    want = [
        model.duration_s(StepWork(0, 0.0, ctx + j * num_seqs, num_seqs)) for j in range(num_steps)
    ]
    assert model.decode_durations_s(ctx, num_seqs, num_steps) == want
