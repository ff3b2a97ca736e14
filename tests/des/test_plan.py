"""Capacity planning (des/plan.py, ``kvroute simulate --plan``): the search, the prices."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.cli import main
from kvroute.des.plan import HOURS_PER_MONTH, Pricing, Probe, plan_rows, smallest_fleet

from .helpers import SMALL


def _probe(replicas: int, p99_s: float, failed: int = 0) -> Probe:
    return Probe(replicas, p99_s, 0.5, 1.0, num_requests=100, num_failed=failed)


def _falling(needed: int):
    """A fleet whose P99 falls with size and meets 1 s from ``needed`` replicas on."""
    calls: list[int] = []

    def probe(n: int) -> Probe:
        calls.append(n)
        return _probe(n, needed / n)

    return probe, calls


@given(needed=st.integers(1, 300), top=st.integers(1, 300))
def test_the_search_finds_the_smallest_fleet_in_few_runs(needed: int, top: int) -> None:
    probe, calls = _falling(needed)
    plan = smallest_fleet("r", probe, 1.0, max_replicas=top)
    assert len(calls) == len(set(calls))  # each size runs once
    assert len(calls) <= 2 * math.ceil(math.log2(top)) + 2
    if needed <= top:
        assert plan.best is not None and plan.best.replicas == needed
        assert [p.replicas for p in plan.probes] == sorted(calls)
    else:
        assert plan.best is None and max(calls) == top


def test_failed_requests_miss_the_slo_even_with_a_low_p99() -> None:
    assert _probe(4, 0.1, failed=1).meets(1.0)
    assert not _probe(4, 0.1, failed=2).meets(1.0)  # over 1 % of the requests
    assert not Probe(4, None, None, 0.0, 0, 0).meets(1.0)
    # requests no engine of this model takes (4xx) fail at any size: not the fleet's fault
    assert Probe(4, 0.1, 0.5, 1.0, num_requests=100, num_failed=0, num_refused=40).meets(1.0)
    assert not Probe(4, 0.1, 0.5, 1.0, num_requests=100, num_failed=1, num_refused=40).meets(1.0)


def test_rows_price_gpus_a_month_and_the_saving_against_the_baseline() -> None:
    plans = [
        smallest_fleet("round_robin", lambda n: _probe(n, 12 / n), 1.0),
        smallest_fleet("kvroute", lambda n: _probe(n, 5 / n), 1.0),
        smallest_fleet("never", lambda n: _probe(n, 9.0), 1.0, max_replicas=8),
    ]
    rows = plan_rows(plans, Pricing(2.0, gpus_per_replica=4), "round_robin")
    rr, kv, never = rows
    assert (rr["replicas"], rr["gpus"]) == (12, 48)
    assert rr["monthly_cost"] == pytest.approx(48 * 2.0 * HOURS_PER_MONTH)
    assert (kv["replicas"], kv["gpus"]) == (5, 20)
    assert kv["saving_per_month"] == pytest.approx(28 * 2.0 * HOURS_PER_MONTH)
    assert kv["saving_share"] == pytest.approx(7 / 12)
    assert never == {"router": "never", "met": False}


def test_the_cli_plans_writes_json_and_says_what_is_missing(tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    args = ["simulate", "--plan", "--workload", "gsp", "--num-requests", "40", "--quiet"]
    args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
    args += ["--routers", "kvroute", "--min-backends", "2", "--max-backends", "4"]
    args += ["--out", str(out), "--no-plots"]
    assert main(args) == 2  # no SLO, no price
    assert "--slo-ttft-p99" in capsys.readouterr().err
    assert main([*args, "--slo-ttft-p99", "30", "--gpu-cost-per-hour", "1.5"]) == 0
    printed = capsys.readouterr().out
    assert "Smallest fleet meeting P99 TTFT <= 30 s" in printed
    data = json.loads((out / "plan.json").read_text())
    assert data["slo_ttft_p99_s"] == 30 and data["baseline"] == "round_robin"
    by_router = {row["router"]: row for row in data["routers"]}
    assert set(by_router) == {"round_robin", "kvroute"}  # the baseline joins by itself
    for name, row in by_router.items():
        probes = data["probes"][name]
        met = [p for p in probes if p["p99_ttft_s"] is not None and p["p99_ttft_s"] <= 30]
        if row["met"]:
            assert row["replicas"] == min(p["replicas"] for p in met)
            assert row["monthly_cost"] == pytest.approx(row["gpus"] * 1.5 * HOURS_PER_MONTH)
        else:
            assert not met
    assert (out / "plan.txt").read_text().startswith("Smallest fleet")
    assert all(p["replicas"] >= 2 for probes in data["probes"].values() for p in probes)


def test_a_fleet_that_served_nothing_misses_the_slo() -> None:
    """Every b2b request is over codellama-13b's context: the plan said 1 replica met a
    P99 of "0.00 s" (the figures of an empty set), refusals excluded from the failures."""
    nothing = {"p99_ttft_ms": 0.0, "completed": 0, "failed": 593, "request_throughput": 0.0}
    probe = Probe.from_result(1, nothing, num_refused=593)
    assert probe.p99_ttft_s is None and probe.num_served == 0
    assert not probe.meets(1.0)
    assert not Probe(1, 0.0, None, 0.0, num_requests=10, num_failed=0, num_refused=10).meets(1.0)
