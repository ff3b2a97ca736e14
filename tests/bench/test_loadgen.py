"""The load generator against the fake streaming server: modes, bounds, measurements."""

from __future__ import annotations

import itertools
import json

import pytest

from kvroute.bench.load import LoadConfig, default_load
from kvroute.bench.runner import run_benchmark
from kvroute.bench.workloads import make_workload

SMALL_PREFIX_REP = {"prefix_tokens": "16", "suffix_tokens": "8", "output_tokens": "4"}


def small(name="prefix-repetition", **extra):
    return make_workload(name, seed=5, overrides={**SMALL_PREFIX_REP, **extra})


async def test_closed_loop_measures_every_request(fake):
    url, state = fake
    load = LoadConfig(mode="closed", num_users=3, num_requests=12, num_warmup=2)
    bench = await run_benchmark(url, small(), load, [f"{url}/b0", f"{url}/b1"])
    r = bench.result
    assert (r["completed"], r["failed"]) == (12, 0)
    assert len(state.bodies) == 14 and sum(rec.warmup for rec in bench.records) == 2
    assert all(b["model"] == "fake-model" and b["stream"] for b in state.bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in state.bodies)
    measured = [rec for rec in bench.records if not rec.warmup]
    assert all(rec.output_tokens == 4 and len(rec.itl_s) == 3 for rec in measured)
    assert all(rec.ttft_s is not None and rec.ttft_s <= rec.e2e_s for rec in measured)
    assert r["max_concurrent_requests"] <= 3
    assert {row["backend"] for row in r["per_backend"]} == {f"{url}/b0", f"{url}/b1"}
    # the fake reports cached_tokens = its own counted hits, so both views agree
    assert r["engine_prefix_hit_rate"] == r["client_cached_token_rate"]
    assert sum(row["num_requests"] for row in r["per_backend"]) == 12
    assert json.dumps(r, allow_nan=False)  # "inf" rates are written as text


async def test_failures_are_counted_not_raised(fake):
    url, state = fake
    state.fail_every = 4
    bench = await run_benchmark(
        url, small(), LoadConfig(mode="closed", num_users=2, num_requests=8)
    )
    assert (bench["completed"], bench["failed"]) == (6, 2)
    failed = [rec for rec in bench.records if not rec.ok]
    assert all(rec.status == 503 and "overloaded" in rec.error for rec in failed)


async def test_open_loop_respects_max_concurrency(fake):
    url, _state = fake
    load = LoadConfig(mode="open", max_concurrency=2, num_requests=10)
    bench = await run_benchmark(url, small(), load)
    assert bench["completed"] == 10
    assert bench["max_concurrent_requests"] <= 2


async def test_open_loop_poisson_sends_every_request(fake):
    url, _ = fake
    load = LoadConfig(mode="open", rates=(200.0,), num_requests=15, seed=1)
    bench = await run_benchmark(url, small(), load)
    assert bench["completed"] == 15


async def test_duration_bound_stops_sending(fake):
    url, _state = fake
    load = LoadConfig(mode="closed", num_users=2, duration_s=0.3)
    bench = await run_benchmark(url, small(), load)
    assert bench["completed"] >= 1
    assert all(rec.start_s < 0.3 for rec in bench.records)


async def test_trace_mode_never_sends_early(fake, tmp_path):
    url, _state = fake
    rows = [
        {"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [0, 100 + i]}
        for i, t in enumerate([0, 0, 0, 3000, 3000, 6000])
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = make_workload(f"mooncake:{path}", overrides={"speedup": "30"})
    bench = await run_benchmark(url, w, default_load(w))
    assert bench["completed"] == 6
    arrivals = {s.request_id: s.arrival_s for s in w.requests()}
    assert all(rec.start_s >= arrivals[rec.request_id] for rec in bench.records)
    # every request after the first can reuse block 0 (512 of its 600 tokens)
    assert bench["cache_ceiling_hit_rate"] == pytest.approx(5 * 512 / (6 * 600))


async def test_multiturn_turns_wait_for_the_previous_answer(fake):
    url, state = fake
    w = make_workload(
        "multiturn",
        overrides={
            "system_prompt_tokens": "32",
            "user_tokens": "4,8",
            "answer_tokens": "3",
            "think_time_s": "0,0.01",
            "max_turns": "4",
        },
    )
    load = LoadConfig(mode="closed", num_users=2, num_requests=12)
    bench = await run_benchmark(url, w, load)
    assert bench["completed"] == 12
    by_session: dict[str, list] = {}
    for rec in bench.records:
        by_session.setdefault(rec.session_id, []).append(rec)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur.start_s >= prev.start_s + prev.e2e_s
    chat = [b for b in state.bodies if "messages" in b]
    assert len(chat) == 12


@pytest.mark.parametrize(
    "fields",
    [
        {"duration_s": float("inf")},
        {"think_time_s": (1.0, float("inf"))},
        {"request_timeout_s": float("inf")},
        {"request_timeout_s": float("nan")},
    ],
)
def test_load_times_must_be_finite(fields):
    with pytest.raises(ValueError, match="finite"):
        LoadConfig(mode="closed", **fields)


async def test_a_target_that_answers_nothing_ends_the_run_early(monkeypatch):
    """A dead port was hammered for the whole duration (thousands of failures a second)."""
    import socket

    from kvroute.bench import loadgen

    monkeypatch.setattr(loadgen, "STOP_SILENT_S", 0.2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    load = LoadConfig(mode="closed", num_users=4, duration_s=600.0, num_warmup=0)
    bench = await run_benchmark(dead, small(), load)
    stopped = bench["stopped_early"]
    assert stopped is not None and stopped.startswith("stopped early: the target answered")
    assert bench["completed"] == 0 and bench["failed"] >= loadgen.STOP_UNANSWERED
    assert "ClientConnectorError" in stopped  # the last failure says why


async def test_a_target_that_answers_errors_is_not_stopped(fake, monkeypatch):
    from kvroute.bench import loadgen

    monkeypatch.setattr(loadgen, "STOP_SILENT_S", 0.0)
    url, state = fake
    state.fail_every = 1  # every request 503: an answer, not silence
    load = LoadConfig(mode="closed", num_users=2, num_requests=80, num_warmup=0)
    bench = await run_benchmark(url, small(), load)
    assert bench["failed"] == 80 and bench["stopped_early"] is None
