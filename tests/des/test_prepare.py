"""Prompts prepared ahead (des/prepare.py): the same ids and keys as preparing them inline,
so a run is the same bytes whether a child process made them or not; a child that fails
says why; a run that ends before its workload stops the child."""

from __future__ import annotations

import multiprocessing
from array import array
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.spec import RequestSpec, Session
from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.mooncake import MooncakeParams, MooncakeReplay, TraceRow
from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.common.tokenizer import Tokenizer
from kvroute.core.keys import text_route_keys
from kvroute.des.prepare import PreparedSessions, Preparer
from kvroute.des.simulation import simulate_router

from .helpers import SMALL, canonical, simulate, small_profile


@pytest.mark.parametrize("router", ["kvroute", "kvroute-exact", "sglang-cache-aware"])
@pytest.mark.parametrize("workload", ["gsp", "multiturn"])
def test_a_run_is_the_same_bytes_with_prompts_made_in_a_child(workload: str, router: str) -> None:
    inline = simulate(router, workload, num_requests=60, prepare_ahead=False)
    ahead = simulate(router, workload, num_requests=60, prepare_ahead=True)
    assert canonical(ahead) == canonical(inline)
    assert inline.result["completed"] == 60


def test_a_trace_replay_is_the_same_bytes_with_prompts_made_in_a_child() -> None:
    rows = [TraceRow(50.0 * i, 700 + 37 * i, 8, tuple(range(i % 3 + 2))) for i in range(40)]
    results = []
    for ahead in (False, True):
        workload = MooncakeReplay(rows, MooncakeParams(input_scale=0.5, spread_ms=0.0))
        bench, _ = simulate_router(
            parse_router("kvroute"), small_profile(), 3, workload, default_load(workload),
            prepare_ahead=ahead,
        )  # fmt: skip
        results.append(canonical(bench))
    assert results[0] == results[1]


@settings(max_examples=40, deadline=None)
@given(
    words=st.lists(st.sampled_from(["a", "bc", "defg", "Hi", "xyz"]), min_size=1, max_size=300),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_prepared_ids_and_keys_are_the_tokenizers_and_the_routers(
    words: list[str], block_size: int
) -> None:
    text = " ".join(words)
    spec = RequestSpec("r", "completions", None, text, 4, len(words), "g")
    prepared = Preparer(block_size)(spec)
    ids = Tokenizer().encode(text)
    assert isinstance(prepared.token_ids, array) and list(prepared.token_ids) == ids
    assert prepared.token_hashes == token_block_hashes(ids, block_size, ROOT_SEED)
    keys, num_bytes = text_route_keys(text, block_size, ROOT_SEED)
    assert (prepared.text_keys, prepared.text_bytes) == (keys, num_bytes)
    assert prepared.key_block_size == block_size


def _failing_sessions() -> Iterator[Session]:
    yield (RequestSpec("ok-0", "completions", None, "one two", 4, 2, "g"),)
    raise ValueError("the trace's third row is broken")


def test_a_child_that_fails_says_why() -> None:
    stream = PreparedSessions(_failing_sessions, Preparer(16), parallel=True)
    try:
        first = next(stream)
        assert stream.take(first[0]).text_bytes == len("one two")
        assert first[0].prompt == ""  # the parent keeps the spec without its text
        with pytest.raises(RuntimeError, match="the trace's third row is broken"):
            next(stream)
    finally:
        stream.close()


def test_a_run_that_ends_before_its_workload_stops_the_child() -> None:
    workload = make_workload("gsp", seed=0, overrides=SMALL["gsp"])  # endless sessions
    bench, _ = simulate_router(
        parse_router("round_robin"), small_profile(), 2, workload,
        default_load(workload, num_requests=30), prepare_ahead=True,
    )  # fmt: skip
    assert bench.result["completed"] == 30
    assert not [p for p in multiprocessing.active_children() if p.name == "kvroute-prepare"]


def test_closing_the_stream_lets_the_child_end_on_its_own() -> None:
    workload = make_workload("gsp", seed=0, overrides=SMALL["gsp"])  # endless sessions
    stream = PreparedSessions(workload.sessions, Preparer(16), parallel=True)
    next(stream)
    stream.close()  # the child is blocked sending: the broken pipe ends it
    assert stream._child is not None and stream._child._proc.exitcode == 0
