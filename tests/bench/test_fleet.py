"""Engine hit rate and per-backend load from two hand-made /metrics snapshots."""

from __future__ import annotations

import pytest

from kvroute.bench.fleet import engine_deltas, fleet_hit_rate, fleet_results
from kvroute.bench.metrics import (
    RequestRecord,
    backend_key,
    counter_delta,
    load_imbalance,
    parse_engine_counters,
)


def page(queries: float, hits: float, engines: int = 1, prefix: str = "vllm:") -> str:
    lines = [
        f"# TYPE {prefix}prefix_cache_queries counter",
        f"# TYPE {prefix}prefix_cache_hits counter",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 3.0',
    ]
    for e in range(engines):
        lines.append(f'{prefix}prefix_cache_queries_total{{engine="{e}"}} {queries / engines}')
        lines.append(f'{prefix}prefix_cache_hits_total{{engine="{e}"}} {hits / engines}')
    return "\n".join(lines) + "\n"


def test_parse_sums_label_sets_and_knows_the_old_names():
    c = parse_engine_counters(page(3000, 1200, engines=2))
    assert (c.prefix_cache_queries, c.prefix_cache_hits, c.prompt_tokens) == (3000, 1200, None)
    old = parse_engine_counters(page(10, 4, prefix="vllm:gpu_"))
    assert (old.prefix_cache_queries, old.prefix_cache_hits) == (10, 4)
    assert parse_engine_counters("# nothing here\nfoo_total 1\n") is None


def test_fleet_hit_rate_and_imbalance_by_hand():
    before = {
        "http://a:1": parse_engine_counters(page(1000, 200)),
        "http://b:2/metrics": parse_engine_counters(page(500, 0)),
    }
    after = {
        "http://a:1": parse_engine_counters(page(3000, 1200)),
        "http://b:2/metrics": parse_engine_counters(page(1500, 250)),
    }
    deltas = engine_deltas(before, after)
    assert set(deltas) == {"http://a:1", "http://b:2"}
    assert (deltas["http://a:1"].queries, deltas["http://a:1"].hits) == (2000, 1000)
    assert deltas["http://b:2"].hit_rate == pytest.approx(0.25)
    # fleet: (1000 + 250) / (2000 + 1000); prefill a 1000, b 750
    assert fleet_hit_rate(deltas) == pytest.approx(1250 / 3000)
    out = fleet_results([], deltas)
    assert out["engine_prefix_hit_rate"] == pytest.approx(1250 / 3000)
    assert out["backend_load_imbalance"] == pytest.approx(1000 / 875)
    rows = {r["backend"]: r for r in out["per_backend"]}
    assert rows["http://b:2"]["prefill_tokens"] == 750
    assert rows["http://a:1"]["engine_prefix_hit_rate"] == pytest.approx(0.5)


def test_reset_counter_and_unreadable_backend():
    assert counter_delta(5000, 100) == 100  # restarted engine: all of it is new
    assert counter_delta(None, 100) is None
    deltas = engine_deltas({"u": None}, {"u": parse_engine_counters(page(10, 5))})
    assert deltas == {} and fleet_hit_rate(deltas) is None


def test_without_snapshots_load_comes_from_client_reports():
    def rec(backend, prompt, cached):
        return RequestRecord("r", "g", None, 0, 0.0, True, 0.1, (), 0.2, prompt, 2, cached, backend)

    records = [rec("http://x/", 100, 60), rec("http://x", 100, 0), rec("http://y", 100, 100)]
    out = fleet_results(records, {})
    rows = {r["backend"]: r for r in out["per_backend"]}
    assert rows["http://x"]["num_requests"] == 2 and rows["http://x"]["prefill_tokens"] == 140
    assert rows["http://y"]["prefill_tokens"] == 0
    assert out["backend_load_imbalance"] == pytest.approx(2.0)
    assert out["client_cached_token_rate"] == pytest.approx(160 / 300)
    assert out["engine_prefix_hit_rate"] is None


def test_imbalance_and_key_edge_cases():
    assert load_imbalance([]) is None and load_imbalance([0, 0]) is None
    assert load_imbalance([3, 1]) == pytest.approx(1.5)
    assert backend_key(" http://h:1/metrics ") == backend_key("http://h:1/") == "http://h:1"
