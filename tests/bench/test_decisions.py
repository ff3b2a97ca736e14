"""The decision analysis on hand-built records: windows, shares, costs, backends, trend."""

from __future__ import annotations

import json

import pytest

from kvroute.bench.compare import RouterOutcome
from kvroute.bench.compare_report import format_analyses, load_compare, write_compare
from kvroute.bench.decisions import analyze, diversion_trend, format_analysis
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.runner import BenchResult
from kvroute.cli import main


def rec(
    start: float,
    decision: str | None,
    *,
    prompt: int = 100,
    cached: int | None = 0,
    ttft: float | None = 0.1,
    e2e: float | None = 1.0,
    ok: bool = True,
    backend: str | None = "http://b0",
    warmup: bool = False,
    predicted: int | None = None,
    left: int | None = None,
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{start}",
        prefix_group="g",
        session_id=None,
        turn=0,
        start_s=start,
        ok=ok,
        ttft_s=ttft if ok else None,
        itl_s=(),
        e2e_s=e2e,
        prompt_tokens=prompt,
        output_tokens=2,
        cached_tokens=cached if ok else None,
        backend=backend,
        decision=decision,
        predicted_cached_tokens=predicted,
        left_cached_tokens=left,
        warmup=warmup,
    )


def test_ten_requests_fill_five_windows_of_two_in_send_order():
    records = [rec(float(t), "prefix") for t in range(10)]  # span 0..9: width 1.8 s
    analysis = analyze(records, 5)
    assert analysis is not None
    assert [w.num_requests for w in analysis.timeline] == [2, 2, 2, 2, 2]
    assert analysis.timeline[0].start_s == 0.0 and analysis.timeline[-1].end_s == 9.0
    assert analysis.timeline[1].start_s == pytest.approx(1.8)
    assert len(analyze(records, 3).timeline) == 3


def test_shares_of_each_decided_window_sum_to_one():
    reasons = ["prefix", "load", "cold", "prefix", "retry", "session", "load", None]
    records = [rec(i * 0.5, reason) for i, reason in enumerate(reasons * 3)]
    analysis = analyze(records, 4)
    assert analysis is not None
    for window in analysis.timeline:
        assert sum(window.decision_share.values()) == pytest.approx(1.0)
    assert sum(s.share for s in analysis.by_reason.values()) == pytest.approx(1.0)
    assert analysis.reasons == ("prefix", "session", "cold", "load", "retry")
    assert analysis.by_reason["prefix"].num_requests == 6  # undecided ones are in no reason


def test_hit_rate_and_recomputed_tokens_per_reason():
    records = [
        rec(0, "prefix", prompt=1000, cached=900, ttft=0.1),
        rec(1, "prefix", prompt=1000, cached=1000, ttft=0.3),
        rec(2, "load", prompt=1000, cached=200, ttft=2.0),
        rec(3, "load", prompt=1000, cached=None, ttft=4.0),  # no usage: not in the hit rate
        rec(4, "load", prompt=1000, cached=None, ok=False),  # failed: no TTFT, no hit
    ]
    analysis = analyze(records, 1)
    assert analysis is not None
    prefix, load = analysis.by_reason["prefix"], analysis.by_reason["load"]
    assert prefix.hit_rate == pytest.approx(0.95) and prefix.mean_recomputed_tokens == 50
    assert load.hit_rate == pytest.approx(0.2) and load.mean_recomputed_tokens == 800
    assert load.num_requests == 3 and load.share == pytest.approx(0.6)
    assert prefix.p50_ttft_ms == pytest.approx(200.0) and load.p50_ttft_ms == pytest.approx(3000)
    window = analysis.timeline[0]
    assert window.hit_rate == pytest.approx(2100 / 3000)
    assert window.hit_rate_by_reason == pytest.approx({"prefix": 0.95, "load": 0.2})
    assert window.num_failed == 1 and window.p50_ttft_ms == pytest.approx(1150.0)  # 4 TTFTs


def test_predicted_hits_and_the_hits_diversions_left_at_home():
    records = [
        rec(0, "prefix", prompt=1000, cached=800, predicted=900, left=0),
        rec(1, "prefix", prompt=1000, cached=1000, predicted=900, left=0),
        rec(2, "load", prompt=1000, cached=0, predicted=0, left=600),
        rec(3, "load", prompt=1000, cached=None, predicted=0, left=900),  # no usage: left out
        rec(4, "cold", prompt=2000, cached=0, predicted=0, left=0),
    ]
    analysis = analyze(records, 1)
    assert analysis is not None
    prefix, load, cold = (analysis.by_reason[k] for k in ("prefix", "load", "cold"))
    assert prefix.predicted_hit_rate == pytest.approx(0.9)
    assert prefix.hit_rate == pytest.approx(0.9)
    # left at home: in points of the run's hit rate (5,000 prompt tokens reported usage)
    assert load.left_hit_rate == pytest.approx(600 / 5000)
    assert prefix.left_hit_rate == cold.left_hit_rate == 0.0
    assert "left at home pp" in format_analysis("kvroute", analysis)
    # a router without the headers: nothing to say, not zero
    plain = analyze([rec(0, "prefix"), rec(1, "load")], 1)
    assert plain is not None and plain.by_reason["load"].left_hit_rate is None
    assert plain.by_reason["load"].predicted_hit_rate is None


def test_a_window_without_requests_is_empty_not_an_error():
    analysis = analyze([rec(0, "prefix"), rec(10, "load")], 5)
    assert analysis is not None
    middle = analysis.timeline[2]
    assert middle.num_requests == 0 and middle.decision_share == {}
    assert middle.hit_rate is None and middle.p50_ttft_ms is None
    assert middle.hit_rate_by_reason == {}
    assert "-" in format_analysis("kvroute", analysis).splitlines()[4]  # no shares shown


def test_routers_without_decisions_give_no_analysis():
    assert analyze([rec(t, None) for t in range(5)]) is None
    assert analyze([]) is None
    assert analyze([rec(-1, "prefix", warmup=True), rec(0, None)]) is None  # warm-up only
    outcome = RouterOutcome("round_robin", BenchResult({}, [rec(0, None)]))
    assert format_analyses({"round_robin": outcome}) == ""
    with pytest.raises(ValueError):
        analyze([rec(0, "prefix")], 0)


def _spiral(load_per_window: list[int]) -> list[RequestRecord]:
    """Ten requests per second-long window, the first ``n`` of them diverted."""
    return [
        rec(w + i / 10, "load" if i < n else "prefix")
        for w, n in enumerate(load_per_window)
        for i in range(10)
    ]


@pytest.mark.parametrize(
    ("load_per_window", "trend"),
    [([1, 2, 4, 6, 8], 0.7), ([8, 6, 4, 2, 1], -0.7), ([3, 3, 3, 3, 3], 0.0), ([0] * 5, 0.0)],
)
def test_diversion_trend_is_load_share_last_minus_first(load_per_window, trend):
    analysis = analyze(_spiral(load_per_window), 5)
    assert analysis is not None
    assert [w.num_requests for w in analysis.timeline] == [10] * 5
    assert analysis.diversion_trend == pytest.approx(trend)


def test_trend_is_unknown_when_an_end_window_has_no_decision():
    analysis = analyze([rec(0, None), rec(5, "load"), rec(10, "load")], 2)
    assert analysis is not None and analysis.timeline[0].decision_share == {}
    assert analysis.diversion_trend is None
    assert diversion_trend(()) is None


def test_per_backend_requests_share_in_flight_and_decision_mix():
    records = [
        rec(0, "prefix", backend="http://a", e2e=2.0),
        rec(1, "prefix", backend="http://a", e2e=2.0),  # overlaps the first: 2 in flight
        rec(2, "load", backend="http://b", cached=0, e2e=1.0),
        rec(3, "load", backend="http://b", cached=0, e2e=1.0),  # starts as the other ends
        rec(3, None, backend=None, ok=False, e2e=None),  # no backend: counted nowhere
    ]
    analysis = analyze(records, 2)
    assert analysis is not None
    a, b = analysis.by_backend
    assert (a.backend, a.num_requests, a.share, a.decisions) == ("http://a", 2, 0.5, {"prefix": 2})
    assert b.decisions == {"load": 2} and b.hit_rate == 0.0
    assert a.peak_in_flight == 2 and b.peak_in_flight == 1
    assert a.mean_in_flight == pytest.approx(4.0 / 4.0)  # 4 request-seconds over 0..4 s


def test_to_json_is_strict_json_and_the_table_names_every_reason():
    analysis = analyze([*_spiral([1, 2, 4, 6, 8]), rec(4.9, "cold", cached=None)], 5)
    assert analysis is not None
    data = json.loads(json.dumps(analysis.to_json(), allow_nan=False))
    assert set(data) == {"reasons", "timeline", "by_reason", "by_backend", "diversion_trend"}
    assert len(data["timeline"]) == 5 and data["by_reason"]["cold"]["hit_rate"] is None
    text = format_analysis("kvroute", analysis)
    assert "+62.7 pp" in text  # load: 1 of 10 first, 8 of 11 last
    for word in ("prefix %", "cold %", "load %", "recomputed tok", "b0"):
        assert word in text


def _outcomes() -> dict[str, RouterOutcome]:
    result = {
        "router": "kvroute",
        "workload": {"name": "gsp"},
        "config": {"num_backends": 1, "profile": "tiny", "seed": 0, "speedup": 1.0},
        "engine_prefix_hit_rate": 0.5,
        "failed": 0,
    }
    return {
        "round_robin": RouterOutcome("round_robin", BenchResult({**result}, [rec(0, None)])),
        "kvroute": RouterOutcome("kvroute", BenchResult(result, _spiral([1, 2, 4, 6, 8]))),
        "sglang": RouterOutcome("sglang", skipped="not installed"),
    }


def test_compare_outputs_carry_the_analysis_and_read_back(tmp_path, capsys):
    out = tmp_path / "run"
    paths = write_compare(_outcomes(), out, plots=True)
    assert "kvroute: decisions over time" in paths["table"].read_text()
    assert paths["decisions:kvroute"] == out / "kvroute" / "decisions.png"
    assert paths["decisions:kvroute"].stat().st_size > 0
    assert not (out / "round_robin" / "decisions.png").exists()
    again = load_compare(out)
    assert again["sglang"].skipped == "not installed"
    assert again["kvroute"].bench is not None
    assert again["kvroute"].bench.records == _outcomes()["kvroute"].bench.records
    assert main(["compare", "--analyze", str(out), "--windows", "2"]) == 0
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "kvroute: what each kind of decision cost" in printed
    assert "+28.0 pp" in printed  # 2 windows of 2.45 s: 7 of 25 diverted, then 14 of 25
    assert main(["compare", "--analyze", str(tmp_path / "missing")]) == 2


def test_short_windows_are_labelled_to_a_tenth_of_a_second():
    """A 3-s run's five windows all read "0-0" in whole seconds."""
    short = analyze([rec(t / 4, "prefix") for t in range(12)], 5)
    assert short is not None
    labels = [line.split()[0] for line in format_analysis("k", short).splitlines()[2:7]]
    assert labels[0] == "0.0-0.6" and len(set(labels)) == 5
    long = analyze([rec(float(t) * 10, "prefix") for t in range(12)], 5)
    assert long is not None
    assert format_analysis("k", long).splitlines()[2].split()[0] == "0-22"
