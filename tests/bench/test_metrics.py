"""Metric definitions on hand-made request timelines (vLLM bench-serve semantics)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from kvroute.bench.metrics import (
    RequestRecord,
    peak_concurrency,
    peak_output_throughput,
    prefix_group_affinity,
    router_stickiness,
    summarize,
)


def rec(start, ttft, itl, e2e, out, *, ok=True, group="g", backend="b", warmup=False, prompt=10):
    return RequestRecord(
        request_id=f"r{start}",
        prefix_group=group,
        session_id=None,
        turn=0,
        start_s=start,
        ok=ok,
        ttft_s=ttft,
        itl_s=tuple(itl),
        e2e_s=e2e,
        prompt_tokens=prompt,
        output_tokens=out,
        cached_tokens=None,
        backend=backend,
        error=None if ok else "HTTP 503",
        warmup=warmup,
    )


TIMELINE = [
    rec(0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4),
    rec(0.05, 0.3, [0.1], 0.4, 2),
    rec(0.1, 0.2, [], 0.2, 1),  # one output token: no TPOT
    rec(0.15, None, [], 0.01, 0, ok=False),
    rec(-1.0, 5.0, [9.0], 9.0, 2, warmup=True),  # warm-up: left out
]


def test_tpot_is_decode_time_per_token_after_the_first():
    assert TIMELINE[0].tpot_s == pytest.approx(0.1 / 3)
    assert TIMELINE[1].tpot_s == pytest.approx(0.1)
    assert TIMELINE[2].tpot_s is None and TIMELINE[3].tpot_s is None


def test_summary_matches_hand_arithmetic():
    s = summarize(TIMELINE, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    # TTFT 100, 300, 200 ms; np.percentile interpolates linearly
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert s["p90_ttft_ms"] == pytest.approx(280)
    assert s["p99_ttft_ms"] == pytest.approx(298)
    # ITL pools every gap: 20, 30, 50, 100 ms
    assert s["mean_itl_ms"] == pytest.approx(50)
    assert s["median_itl_ms"] == pytest.approx(40)
    assert s["p99_itl_ms"] == pytest.approx(98.5)
    assert s["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert s["mean_e2el_ms"] == pytest.approx(800 / 3)
    assert s["p50_e2el_ms"] == pytest.approx(200)
    assert s["max_concurrent_requests"] == 4  # all four in flight at t = 0.15


def test_every_latency_key_exists_and_is_zero_without_samples():
    s = summarize([], duration_s=0.0)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            assert s[f"{stat}_{metric}_ms"] == 0.0
    assert s["request_throughput"] == 0.0


def test_percentiles_are_numpy_linear_on_many_values():
    ttfts = [0.001 * k for k in range(1, 101)]
    s = summarize([rec(i, t, [], t, 1) for i, t in enumerate(ttfts)], 1.0)
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(np.arange(1, 101), 99))


def test_ranvier_stickiness_same_backend_as_last_time():
    order = [("A", "x"), ("A", "x"), ("A", "y"), ("B", "y"), ("B", "y")]
    records = [rec(i, 0.1, [], 0.2, 2, group=g, backend=b) for i, (g, b) in enumerate(order)]
    # A: miss (first), hit, miss (switch); B: miss (first), hit
    assert router_stickiness(records) == pytest.approx(2 / 5)
    assert prefix_group_affinity(records) == pytest.approx(4 / 5)
    alternating = [rec(i, 0.1, [], 0.2, 2, backend="xy"[i % 2]) for i in range(10)]
    assert router_stickiness(alternating) == 0.0
    assert router_stickiness([]) is None


def test_stickiness_follows_response_order_not_send_order():
    late = rec(0.0, 1.0, [], 1.1, 2, backend="x")  # sent first, answered last
    early = rec(0.1, 0.1, [], 0.2, 2, backend="y")
    again = rec(2.0, 0.1, [], 0.2, 2, backend="x")
    # response order: early(y) miss, late(x) miss, again(x) hit
    assert router_stickiness([late, early, again]) == pytest.approx(1 / 3)


def test_peak_concurrency_counts_touching_intervals_once():
    back_to_back = [rec(0.0, 0.1, [], 1.0, 2), rec(1.0, 0.1, [], 1.0, 2)]
    assert peak_concurrency(back_to_back) == 1


def _record(i: int, start: float, ttft: float | None, itl: tuple[float, ...], e2e: float | None):
    return RequestRecord(
        request_id=str(i), prefix_group="g", session_id=None, turn=0, start_s=start,
        warmup=False, ok=ttft is not None, ttft_s=ttft, itl_s=itl, e2e_s=e2e,
        prompt_tokens=1, output_tokens=len(itl) + 1, cached_tokens=None, backend=None,
        status=200,
    )  # fmt: skip


def test_peaks_equal_the_running_sums_they_vectorize() -> None:
    """``peak_concurrency`` and ``peak_output_throughput`` (numpy) equal the sweeps they
    replaced: a sorted event walk and a running sum per record, ties included."""

    def walked(records: list[RequestRecord]) -> tuple[int, float]:
        events = []
        buckets: Counter[int] = Counter()
        for r in records:
            if r.e2e_s is not None:
                events += [(r.start_s, 1), (r.start_s + r.e2e_s, -1)]
            if r.ok and r.ttft_s is not None:
                t = r.start_s + r.ttft_s
                buckets[int(t)] += 1
                for gap in r.itl_s:
                    t += gap
                    buckets[int(t)] += 1
        level = peak = 0
        for _, step in sorted(events):
            level += step
            peak = max(peak, level)
        return peak, float(max(buckets.values(), default=0))

    rng = random.Random(0)
    pick = [0.0, 0.1, 0.25, 0.5, 1.0]  # exact ties between starts, ends and buckets
    for _ in range(2000):
        records = []
        for i in range(rng.randrange(30)):
            ttft = rng.choice([None, 0.5, rng.uniform(0, 2)])
            itl = tuple(rng.choice([*pick, rng.uniform(0, 0.7)]) for _ in range(rng.randrange(8)))
            e2e = rng.choice([None, 0.5, rng.uniform(0, 3)])
            start = rng.choice([*pick, rng.uniform(0, 5)])
            records.append(_record(i, start, ttft, itl if ttft is not None else (), e2e))
        assert (peak_concurrency(records), peak_output_throughput(records)) == walked(records)
