"""The discrete-event simulator: exact on a hand-computed scenario, fast-forward equal to
stepping, deterministic (also across PYTHONHASHSEED), ceilings that bound every router."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.mooncake import MooncakeParams, MooncakeReplay, TraceRow
from kvroute.des.simulation import Timing, simulate_router
from kvroute.engine import PROFILES

from .helpers import SMALL, canonical, simulate, small_profile

ROUTERS = ("round_robin", "consistent_hash", "kvroute", "kvroute-exact")


def test_a_hand_computed_scenario_is_reproduced_exactly() -> None:
    # One engine, step = 10 ms + 1 ms per prefill token; 4-token blocks. Two requests of the
    # same 9-token prompt, 1 s apart, 2 output tokens each:
    #   r0: prefill 9 tokens (19 ms) -> first token at 0.019; a decode (10 ms) -> end 0.029
    #   r1: 8 tokens cached (2 blocks; the 9th is computed), prefill 1 (11 ms), decode 10 ms
    profile = small_profile(
        block_size=4, kv_capacity_tokens=64, max_model_len=64, t_fwd0_ms=10.0,
        b_ms_per_token=1.0, c_ms_per_pair=0.0, k_ctx_ms_per_token=0.0, per_seq_ms=0.0,
        a_api_ms=0.0,
    )  # fmt: skip
    rows = [TraceRow(0.0, 9, 2, (1,)), TraceRow(1000.0, 9, 2, (1,))]
    workload = MooncakeReplay(rows, MooncakeParams(spread_ms=0.0))
    load = default_load(workload)
    bench, _ = simulate_router(
        parse_router("round_robin"), profile, 1, workload, load, timing=Timing(0.0, 0.0)
    )
    r0, r1 = sorted(bench.records, key=lambda r: r.start_s)
    assert (r0.start_s, r1.start_s) == (0.0, 1.0)
    assert r0.ttft_s == pytest.approx(0.019, abs=1e-12)
    assert r0.e2e_s == pytest.approx(0.029, abs=1e-12)
    assert r0.itl_s == pytest.approx((0.010,), abs=1e-12)
    assert r1.ttft_s == pytest.approx(0.011, abs=1e-12)
    assert r1.e2e_s == pytest.approx(0.021, abs=1e-12)
    assert (r0.cached_tokens, r1.cached_tokens) == (0, 8)
    result = bench.result
    assert result["engine_prefix_hit_rate"] == 8 / 18
    assert result["cache_ceiling_hit_rate"] == 8 / 18
    assert result["pooled_lru_hit_rate"] == 8 / 18 and result["belady_hit_rate"] == 8 / 18
    assert result["completed"] == 2 and result["duration"] == pytest.approx(1.021, abs=1e-12)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("workload", ["ranvier-stress", "gsp", "multiturn"])
def test_fast_forward_gives_exactly_what_stepping_gives(workload: str, router: str) -> None:
    stepped = simulate(router, workload, fast_forward=False, num_requests=80)
    fast = simulate(router, workload, num_requests=80)
    assert canonical(fast) == canonical(stepped)
    assert fast.result["simulation"]["fast_forwards"] > 0 or router == "kvroute-exact"
    assert fast.result["simulation"]["engine_steps"] == stepped.result["simulation"]["engine_steps"]


@pytest.mark.parametrize("workload", ["ranvier-stress", "multiturn"])
def test_scrapes_inside_a_fast_forward_read_it_without_cutting_it(workload: str) -> None:
    # the llm-d model scrapes every 50 ms, so most scrapes land inside runs of decodes
    stepped = simulate("llm-d", workload, fast_forward=False, num_requests=60)
    fast = simulate("llm-d", workload, num_requests=60)
    assert canonical(fast) == canonical(stepped)
    steps = fast.result["simulation"]["engine_steps"]
    assert steps == stepped.result["simulation"]["engine_steps"]
    # spans run whole: far fewer of them than the 50-ms scrapes that fell inside them
    assert 0 < fast.result["simulation"]["fast_forwards"] < steps / 8


@pytest.mark.parametrize("seed", [1, 2])
def test_fast_forward_equals_stepping_under_an_open_loop_with_a_tight_cache(seed: int) -> None:
    args = {"workload": "gsp", "seed": seed, "num_requests": 100, "mode": "open", "rates": (6.0,)}
    profile = small_profile(kv_capacity_tokens=2_496, max_model_len=2_496)
    stepped = simulate("kvroute", **args, fast_forward=False, profile=profile)
    fast = simulate("kvroute", **args, profile=profile)
    assert canonical(fast) == canonical(stepped)


def test_the_same_seed_gives_the_same_bytes_and_another_seed_does_not() -> None:
    a, b = simulate("kvroute", seed=3), simulate("kvroute", seed=3)
    assert canonical(a) == canonical(b)
    assert canonical(simulate("kvroute", seed=4)) != canonical(a)


def test_outputs_are_byte_identical_across_hash_seeds(tmp_path) -> None:
    def run(hash_seed: str) -> tuple[bytes, bytes]:
        out = tmp_path / hash_seed
        args = [sys.executable, "-m", "kvroute.cli", "simulate", "--workload", "gsp"]
        args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
        args += ["--backends", "3", "--routers", "kvroute,kvroute-exact", "--num-requests", "60"]
        args += ["--out", str(out), "--no-plots", "--quiet"]
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run(args, env=env, check=True, capture_output=True, timeout=300)
        records = b"".join(
            (out / n / "records.jsonl").read_bytes() for n in ("kvroute", "kvroute-exact")
        )
        return (out / "compare.json").read_bytes(), records

    assert run("1") == run("4242")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("workload", ["gsp", "multiturn", "zipf-hot"])
def test_belady_bounds_every_router_and_pooled_lru(workload: str, seed: int) -> None:
    profile = small_profile(kv_capacity_tokens=1_792, max_model_len=1_792)
    for router in ROUTERS:
        r = simulate(router, workload, seed=seed, num_requests=60, profile=profile).result
        if r["engine_prefix_hit_rate"] is None:
            continue
        assert r["engine_prefix_hit_rate"] <= r["belady_hit_rate"] + 1e-12, router
        assert r["pooled_lru_hit_rate"] <= r["belady_hit_rate"] + 1e-12
        assert r["belady_hit_rate"] <= r["cache_ceiling_hit_rate"] + 1e-12


def test_results_carry_compare_keys_and_engine_time() -> None:
    from tests.bench.test_cli import DESIGN_KEYS

    r = simulate("kvroute", "ranvier-stress").result
    assert set(r) >= DESIGN_KEYS
    assert r["completed"] == 120 and r["failed"] == 0
    assert r["config"]["time_unit"].startswith("engine seconds")
    assert len(r["per_backend"]) == 3
    assert sum(row["num_requests"] for row in r["per_backend"]) == 120
    assert r["router_stickiness"] is not None


def test_warm_up_is_left_out_and_precedes_the_run() -> None:
    bench = simulate("kvroute", "ranvier-stress", num_warmup=10)
    warm = [r for r in bench.records if r.warmup]
    assert len(warm) >= 10 and bench.result["completed"] == 120
    assert len(bench.records) == len(warm) + 120


def test_duration_bounds_the_run_in_engine_time() -> None:
    w = simulate("round_robin", "ranvier-stress", num_requests=None, duration_s=20.0)
    assert all(r.start_s < 20.0 for r in w.records)
    assert w.result["completed"] > 0


def test_a_prompt_too_long_for_the_engine_is_sent_and_refused_with_400() -> None:
    # As on the HTTP rig: the router sends it (it knows the context length, not the exact
    # tokens of a text prompt), the engine answers 400 on arrival and runs nothing
    profile = small_profile(kv_capacity_tokens=496, max_model_len=496)
    bench = simulate("kvroute", "gsp", profile=profile, num_requests=10)
    assert bench.result["failed"] == 10
    assert {r.status for r in bench.records} == {400}
    assert all(r.backend is not None and r.e2e_s > 0 for r in bench.records)
    assert all(row["prefix_cache_queries"] == 0 for row in bench.result["per_backend"])


def test_records_match_the_engine_counters() -> None:
    bench = simulate("kvroute", "multiturn")
    cached = sum(r.cached_tokens or 0 for r in bench.records if not r.warmup)
    rows = bench.result["per_backend"]
    assert cached == sum(row["prefix_cache_hits"] for row in rows)
    prompt = sum(r.prompt_tokens for r in bench.records if not r.warmup)
    assert prompt == sum(row["prefix_cache_queries"] for row in rows)


def test_without_per_record_gaps_the_itl_figures_are_the_same() -> None:
    from kvroute.bench.workloads import make_workload

    from .helpers import SMALL

    def run(keep: bool):
        w = make_workload("gsp", seed=0, overrides=SMALL["gsp"])
        load = default_load(w, num_requests=60)
        return simulate_router(parse_router("kvroute"), small_profile(), 3, w, load, keep_itl=keep)[
            0
        ]

    kept, dropped = run(True), run(False)
    assert all(r.itl_s == () for r in dropped.records)
    assert any(r.itl_s for r in kept.records)
    itl_keys = [k for k in kept.result if "_itl_" in k]
    assert itl_keys and all(kept.result[k] == dropped.result[k] for k in itl_keys)
    assert kept.result["p99_itl_ms"] > 0


def test_without_ceilings_only_the_ceilings_are_missing() -> None:
    from kvroute.bench.workloads import make_workload

    def run(ceilings: bool):
        w = make_workload("gsp", seed=0, overrides=SMALL["gsp"])
        load = default_load(w, num_requests=60)
        spec, profile = parse_router("kvroute"), small_profile()
        return simulate_router(spec, profile, 3, w, load, compute_ceilings=ceilings)[0]

    full, bare = run(True), run(False)
    ceiling_keys = ("cache_ceiling_hit_rate", "pooled_lru_hit_rate", "belady_hit_rate")
    assert all(full.result[k] is not None for k in ceiling_keys)
    assert all(bare.result[k] is None for k in ceiling_keys)
    assert bare.result["pooled_capacity_blocks"] == full.result["pooled_capacity_blocks"]
    rest = set(full.result) - set(ceiling_keys)
    assert {k: bare.result[k] for k in rest} == {k: full.result[k] for k in rest}
    assert bare.result["engine_prefix_hit_rate"] > 0


def test_a_peer_model_scrapes_the_engines_as_its_router_does() -> None:
    from kvroute.des.router import SimRouter

    urls = ["http://a", "http://b"]
    assert SimRouter(parse_router("llm-d"), urls, "m").scrape_interval_s == 0.05
    kvroute = SimRouter(parse_router("kvroute"), urls, "m")
    assert kvroute.scrape_interval_s == kvroute.config.health.scrape_interval_s == 2.0
    assert SimRouter(parse_router("kvroute:llm-d-no-hit-lru"), urls, "m").scrape_interval_s == 0.05


def test_thousands_of_sessions_due_at_one_instant_start_without_recursing() -> None:
    # rate inf: every session is due at the run's first instant, and each starts the next
    # from inside the scheduler; one frame per session would pass Python's recursion limit
    n = sys.getrecursionlimit() + 500
    bench = simulate(
        "round_robin", "gsp", mode="open", rates=(math.inf,), max_concurrency=None, num_requests=n
    )
    measured = [r for r in bench.records if not r.warmup]
    assert len(measured) == n and all(r.ok for r in measured)
    assert sum(r.start_s == measured[0].start_s for r in measured) > sys.getrecursionlimit()


def test_a_router_config_file_is_read_once_and_may_not_add_backends(tmp_path) -> None:
    from kvroute.des.router import router_config

    spec, urls = parse_router("kvroute"), ["http://sim-0", "http://sim-1"]
    path = tmp_path / "router.yaml"
    path.write_text("fleet: {max_index_entries: 9}\n")
    config = router_config(spec, urls, str(path))
    assert config.fleet.max_index_entries == 9
    assert [b.url for b in config.backends] == urls
    path.write_text("backends: [{url: 'http://x:1'}]\n")
    with pytest.raises(ValueError, match="lists backends"):
        router_config(spec, urls, str(path))
    with pytest.raises(ValueError, match="No such file"):
        router_config(spec, urls, str(tmp_path / "none.yaml"))


def test_the_result_counts_requests_under_each_reuse_verdict() -> None:
    from kvroute.bench.compare import RouterOutcome
    from kvroute.des.report import format_reuse_regime

    outcomes = {}
    for router in ("kvroute", "round_robin"):
        bench = simulate(router, "gsp", num_requests=60)
        regime = bench.result["simulation"]["reuse_regime"]
        routed = sum(regime[k] for k in regime if k.startswith("requests_"))
        assert routed == len(bench.records) >= 60  # every request routed, warm-up included
        assert regime["late_at_end"] >= 0 and regime["ghost_at_end"] >= 0
        outcomes[router] = RouterOutcome(router, bench=bench)
    lines = format_reuse_regime(outcomes).splitlines()
    assert [line.split()[0] for line in lines[4:]] == ["kvroute"]  # the policy that uses it


def test_records_carry_the_prediction_and_what_a_diversion_left() -> None:
    """As the live router's headers say: every record the hit the router expected, and a
    request moved away from its prefix's holder the part of the hit predicted there that
    its new backend lacks (two backends under 48 users: some holders get too busy to
    stay on)."""
    bench = simulate("kvroute", "gsp", num_requests=200, num_backends=2, max_concurrency=48)
    moved = [r for r in bench.records if r.decision in ("load", "new")]
    stayed = [r for r in bench.records if r.decision not in ("load", "new")]
    assert moved and all(r.left_cached_tokens is not None for r in moved)
    assert any(r.left_cached_tokens for r in moved if r.decision == "load")
    assert stayed and all(r.left_cached_tokens == 0 for r in stayed)
    assert all(r.predicted_cached_tokens is not None for r in bench.records)
    assert any(r.predicted_cached_tokens for r in stayed)
    by_reason = bench.result["decision_analysis"]["by_reason"]
    assert by_reason["load"]["left_hit_rate"] > 0
    assert by_reason["prefix"]["left_hit_rate"] == 0


def test_long_prompts_the_first_estimate_puts_over_the_context_still_go_home() -> None:
    """ranvier-stress's largest prompts (8,048 tokens) on an 8,192-token context: before
    any answer the router's text estimate puts them at ~9,600 tokens. They are not taken
    for prompts the engine refuses: the first is recorded where it went, and the rest of
    its group follow it there instead of scattering over the fleet."""
    w = make_workload("ranvier-stress", seed=0)
    load = default_load(w, num_requests=60, num_warmup=0, seed=0)
    bench, _ = simulate_router(
        parse_router("kvroute"), PROFILES["codellama-13b-a100-40g"], 8, w, load,
        compute_ceilings=False, prepare_ahead=False,
    )  # fmt: skip
    longest = [r for r in bench.records if r.prompt_tokens > 8_000]
    assert len(longest) >= 5 and len({r.prefix_group for r in longest}) == 1
    assert len({r.backend for r in longest}) == 1
    assert [r.decision for r in longest].count("cold") == 1
    assert all(r.cached_tokens for r in longest[1:])


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
def test_timing_latencies_are_finite_and_not_negative(value) -> None:
    for fields in ({"request_overhead_s": value}, {"kv_event_delay_s": value}):
        with pytest.raises(ValueError, match="finite"):
            Timing(**fields)
