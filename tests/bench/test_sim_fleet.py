"""``run_benchmark`` against a real 2-backend ``tiny`` simulated fleet (engines' own counters)."""

from __future__ import annotations

import pytest

from kvroute.bench.load import LoadConfig
from kvroute.bench.runner import run_benchmark
from kvroute.bench.workloads import make_workload

sim_server = pytest.importorskip("kvroute.sim.server")


@pytest.fixture
async def fleet():
    fleet = await sim_server.start_fleet(2, profile="tiny")
    yield fleet
    await fleet.close()


async def test_bench_one_engine_of_two_reads_both_engines_counters(fleet):
    w = make_workload(
        "gsp",
        seed=1,
        overrides={
            "num_groups": "3",
            "system_prompt_tokens": "256",
            "question_tokens": "32",
            "output_tokens": "8",
        },
    )
    load = LoadConfig(mode="closed", num_users=3, num_requests=24, num_warmup=3)
    bench = await run_benchmark(fleet.urls[0], w, load, fleet.urls)
    r = bench.result
    assert (r["completed"], r["failed"]) == (24, 0)
    assert r["total_input_tokens"] == 24 * 288  # usage.prompt_tokens from the engine
    rows = {row["backend"]: row for row in r["per_backend"]}
    busy, idle = rows[fleet.urls[0]], rows[fleet.urls[1]]
    assert busy["num_requests"] == 24 and idle["prefill_tokens"] == 0
    assert r["backend_load_imbalance"] == pytest.approx(2.0)  # all prefill on one of two
    # 3 shared 256-token system prompts, warmed up: the engine reports real hits
    assert r["engine_prefix_hit_rate"] > 0.5
    # one backend, so no switch: only each group's first measured sighting is a miss
    assert r["router_stickiness"] == pytest.approx(21 / 24)


@pytest.mark.parametrize("workload", ["gsp", "multiturn"])
async def test_non_streaming_clients_are_measured_from_the_whole_answer(fleet, workload):
    """``stream=False`` (the openai SDK's default): one JSON answer per request, its usage
    read, TTFT equal to the whole response time, no ITL; chat and completions alike."""
    if workload == "gsp":
        overrides = dict(
            num_groups="2", system_prompt_tokens="128", question_tokens="16", output_tokens="8"
        )
    else:
        overrides = dict(
            system_prompt_tokens="64", user_tokens="8,16", answer_tokens="8", think_time_s="0,0"
        )
    w = make_workload(workload, seed=3, overrides=overrides)
    load = LoadConfig(mode="closed", num_users=2, num_requests=10, stream=False)
    bench = await run_benchmark(fleet.urls[0], w, load, fleet.urls)
    assert (bench.result["completed"], bench.result["failed"]) == (10, 0)
    for rec in bench.records:
        assert rec.ttft_s == pytest.approx(rec.e2e_s, abs=0.05)
        assert rec.itl_s == () and rec.output_tokens == 8
    assert bench.result["total_input_tokens"] == sum(r.prompt_tokens for r in bench.records)
    assert bench.result["config"]["load"]["stream"] is False
