"""The agentic workload as a Mooncake-format trace: shape, sharing, and a replay of it."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from kvroute.bench.workloads.agentic import Agentic, AgenticParams
from kvroute.bench.workloads.agentic_trace import agentic_trace
from kvroute.bench.workloads.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeReplay,
    TraceRow,
    infinite_cache_hit_rate,
)


@pytest.fixture(scope="module")
def rows():
    return agentic_trace(Agentic(seed=3), users=6, duration_s=240.0)


def test_rows_are_mooncake_rows_in_arrival_order_within_the_duration(rows):
    assert len(rows) > 20
    stamps = [r.timestamp_ms for r in rows]
    assert stamps == sorted(stamps) and stamps[0] >= 0 and stamps[-1] <= 240_000
    for r in rows:
        assert len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_TOKENS)
        assert r.input_length + r.output_length <= AgenticParams().max_context_tokens
        assert set(r.to_json_obj()) == {"timestamp", "input_length", "output_length", "hash_ids"}
        json.dumps(r.to_json_obj())


def test_a_turn_extends_the_full_blocks_of_the_previous_one(rows):
    by_session: dict[int, list] = {}
    for r in rows:
        by_session.setdefault(r.session, []).append(r)
    assert max(len(turns) for turns in by_session.values()) >= 3
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for a, b in pairwise(turns):
            full = a.input_length // MOONCAKE_BLOCK_TOKENS
            assert b.input_length > a.input_length
            assert b.hash_ids[:full] == a.hash_ids[:full]
            # the previous turn's partial last block is not the same content any more
            if len(a.hash_ids) > full:
                assert a.hash_ids[full] not in b.hash_ids
            assert b.timestamp_ms > a.timestamp_ms


def test_sessions_share_exactly_their_harness_blocks():
    workload = Agentic(seed=0)
    rows = agentic_trace(workload, users=12, duration_s=120.0)
    firsts = {r.session: r for r in rows if r.turn == 0}
    harness = {s: workload.session(s)[0].messages[0][1] for s in firsts}
    sessions = sorted(firsts)
    same = [(a, b) for a in sessions for b in sessions if a < b and harness[a] == harness[b]]
    other = [(a, b) for a in sessions for b in sessions if a < b and harness[a] != harness[b]]
    assert same and other
    for a, b in same:
        shared = len(set(firsts[a].hash_ids) & set(firsts[b].hash_ids))
        assert shared >= AgenticParams().harness_tokens[0] // MOONCAKE_BLOCK_TOKENS - 1
        assert firsts[a].hash_ids[:shared] == firsts[b].hash_ids[:shared]
    for a, b in other:
        assert not set(firsts[a].hash_ids) & set(firsts[b].hash_ids)


def test_same_arguments_same_rows_and_other_seeds_other_rows():
    make = lambda seed: agentic_trace(Agentic(seed=seed), users=4, duration_s=60.0)  # noqa: E731
    assert make(1) == make(1)
    assert make(1) != make(2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="users"):
        agentic_trace(Agentic(), users=0, duration_s=60.0)
    with pytest.raises(ValueError, match="duration_s"):
        agentic_trace(Agentic(), users=1, duration_s=0.0)
    with pytest.raises(ValueError, match="itl_s"):
        agentic_trace(Agentic(), users=1, duration_s=60.0, itl_s=-1.0)


def test_its_replay_reuses_what_the_sessions_reuse(rows):
    trace = [TraceRow(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in rows]
    replay = MooncakeReplay(trace)
    specs = [spec for (spec,) in replay.sessions()]
    assert len(specs) == len(rows)
    assert [s.num_prompt_tokens for s in specs] == [r.input_length for r in rows]
    # a later turn's prompt starts with the previous turn's full blocks, word for word
    last: dict[int, str] = {}
    for r, spec in zip(rows, specs, strict=True):
        if r.session in last:
            full = last[r.session].split(" ")
            assert spec.prompt is not None
            words = spec.prompt.split(" ")
            keep = (len(full) // MOONCAKE_BLOCK_TOKENS) * MOONCAKE_BLOCK_TOKENS
            assert words[:keep] == full[:keep]
        last[r.session] = spec.prompt or ""
    # sessions that grow turn by turn: most of every later prompt was seen before
    assert infinite_cache_hit_rate(trace) > 0.6
