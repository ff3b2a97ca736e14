"""The soak verdict (pure), and the opt-in 3-minute soak (KVROUTE_SOAK=1)."""

from __future__ import annotations

import json
import os

import pytest

from kvroute.bench.hardening import Shot
from kvroute.bench.soak import Sample, SoakConfig, classify, flatness, run_soak, write_outputs


def _samples(rss: list[float], *, fds: int = 30, step_s: float = 10.0) -> list[Sample]:
    return [
        Sample(
            t_s=i * step_s,
            rss_mib=v,
            fds=fds,
            index_blocks=100.0,
            tasks=20.0,
            in_flight_requests=1.0,
            in_flight_tokens=50.0,
            router_in_flight=1.0,
            num_done=i,
            num_failed=0,
        )
        for i, v in enumerate(rss)
    ]


def test_flat_after_warm_up_ignores_the_warm_up_and_a_fall():
    # warm-up from 40 to 100 MiB, then level 100 and a small rise, then a fall
    rss = [40, 70, 100, 100, 101, 100, 102, 103, 104, 90, 90, 90]
    verdict = flatness(_samples(rss), warmup_s=20.0, tolerance=0.10)
    assert verdict["rss_mib"]["level"] == 100 and verdict["rss_mib"]["end"] == 90
    assert all(v["flat"] for v in verdict.values())


def test_growth_beyond_ten_percent_plus_slack_is_not_flat():
    rss = [100, 100, 100, 104, 108, 112, 116, 120, 124, 128]  # +28 %
    verdict = flatness(_samples(rss), warmup_s=0.0, tolerance=0.10)
    assert verdict["rss_mib"]["end"] == 124 and verdict["rss_mib"]["limit"] == pytest.approx(114)
    assert not verdict["rss_mib"]["flat"] and verdict["fds"]["flat"]


def test_too_few_samples_after_warm_up_is_not_a_pass():
    verdict = flatness(_samples([50, 50, 50]), warmup_s=25.0, tolerance=0.10)
    assert not verdict["rss_mib"]["flat"]


DEAD = '{"error":{"message":"http://h:1/v1/completions closed the connection before answering"}}'


@pytest.mark.parametrize(
    ("kind", "failure", "t0", "t1", "expected", "detail"),
    [
        ("chat", None, 1.0, 2.0, "ok", ""),
        ("bad_json", None, 1.0, 2.0, "expected_4xx", ""),
        ("disconnect", None, 1.0, 2.0, "disconnected", ""),
        ("chat_stream", "stream_error", 9.0, 10.5, "cut_by_restart", ""),  # in flight at the kill
        ("chat", "http_502", 10.1, 10.2, "failed", ""),  # sent after the kill: must be retried
        ("chat", "http_502", 10.1, 10.2, "cut_by_restart", DEAD),  # on a dead pooled connection
        ("chat", "http_502", 12.0, 12.1, "failed", DEAD),  # long after: the router must know
        ("bad_json", "http_500", 1.0, 2.0, "failed", ""),
    ],
)
def test_outcome_classes(kind, failure, t0, t1, expected, detail):
    shot = Shot(kind, t0, t1, None, failure, None, detail)
    assert classify(shot, kill_times=[10.0]) == expected


@pytest.mark.soak
@pytest.mark.skipif(os.environ.get("KVROUTE_SOAK") != "1", reason="opt-in: KVROUTE_SOAK=1")
@pytest.mark.timeout(420)
async def test_three_minute_soak_is_flat_leaks_nothing_and_loses_nothing(tmp_path):
    config = SoakConfig(duration_s=180.0, sample_s=5.0, restart_every_s=45.0, warmup_s=30.0,
                        out=tmp_path)  # fmt: skip
    result = await run_soak(config)
    write_outputs(result)
    verdict = {k: result.to_json()[k] for k in ("flat", "leaked", "outcomes", "failures")}
    assert result.passed, json.dumps(verdict, indent=1, default=str)
    assert len(result.restarts) == 3 and result.outcomes["ok"] > 1000
