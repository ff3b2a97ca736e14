"""The chaos schedule (pure: seeded, bounded) and a short chaos run through a real router."""

from __future__ import annotations

import json

import pytest

from kvroute.bench.chaos import ChaosConfig, run_chaos
from kvroute.bench.chaos_faults import FAULT_KINDS, attribute, make_schedule
from kvroute.bench.hardening import Shot


def test_same_seed_same_schedule_and_another_seed_another():
    a = make_schedule(7, 3, 60.0)
    assert a == make_schedule(7, 3, 60.0)
    assert a != make_schedule(8, 3, 60.0)
    assert {e.kind for e in a} <= set(FAULT_KINDS) and len(a) >= 10


@pytest.mark.parametrize("seed", range(20))
def test_schedule_keeps_one_backend_free_and_one_fault_per_backend(seed):
    n, duration = 3, 40.0
    events = make_schedule(seed, n, duration, quiet_tail_s=2.0)
    for e in events:
        assert 0 < e.start_s < e.end_s <= duration - 2.0
        assert 0 <= e.backend < n
        active = [o for o in events if o.start_s <= e.start_s < o.end_s]
        assert len({o.backend for o in active}) == len(active), "one fault per backend"
        assert len(active) <= n - 1, "a backend stays fault-free"


def test_schedule_draws_only_the_kinds_asked_and_refuses_unknown_ones():
    assert {e.kind for e in make_schedule(1, 4, 120.0, kinds=("kill", "kv_gap"))} == {
        "kill", "kv_gap",
    }  # fmt: skip
    with pytest.raises(ValueError, match="fault kinds"):
        make_schedule(1, 3, 10.0, kinds=("meteor",))


def test_failures_are_attributed_to_the_faults_they_overlap():
    schedule = make_schedule(3, 3, 30.0)
    first = schedule[0]
    during = Shot("chat", first.start_s + 0.1, first.start_s + 0.2, 502, "http_502", None)
    ok = Shot("chat", first.start_s, first.start_s + 0.1, 200, None, None)
    counts, failed = attribute([during, ok], schedule, grace_s=0.0)
    assert counts[first.kind] >= 1 and failed[first.kind] == [during]
    lone = Shot("chat", 1000.0, 1001.0, 502, "http_502", None)
    counts, _ = attribute([lone], schedule, grace_s=0.0)
    assert counts == {"none": 1}


@pytest.mark.slow
async def test_short_chaos_run_keeps_every_invariant(tmp_path):
    """~30 s: every fault kind on 3 simulators behind a real router in exact mode."""
    config = ChaosConfig(duration_s=24.0, seed=66, backends=3, users=4, mean_gap_s=1.0,
                         fault_s=(1.5, 4.0), out=tmp_path)  # fmt: skip
    schedule = make_schedule(66, 3, 24.0, mean_gap_s=1.0, fault_s=(1.5, 4.0))
    assert {e.kind for e in schedule} == set(FAULT_KINDS)  # this seed draws every kind
    result = await run_chaos(config)
    report = json.dumps(result.to_json()["invariants"], indent=1)
    assert result.passed, report
    assert result.outcomes.get("ok", 0) > 100, result.outcomes


def test_a_failure_naming_its_backend_is_attributed_to_that_backend_only():
    schedule = make_schedule(66, 3, 24.0, mean_gap_s=1.0, fault_s=(1.5, 4.0))
    urls = ["http://h:1", "http://h:2", "http://h:3"]
    e = schedule[0]
    other = next(o for o in urls if o != urls[e.backend])
    named = Shot("chat", e.start_s, e.start_s + 0.01, 502, "http_502", None, f"{other}/v1 died")
    ours = Shot("chat", e.start_s, e.start_s + 0.01, 502, "http_502", urls[e.backend])
    counts, _ = attribute([named, ours], [e], grace_s=0.0, urls=urls)
    assert counts == {e.kind: 1, "none": 1}
