"""Fleet-level results: engine hit rate from two /metrics snapshots, per-backend table.

Pure: the runner scrapes each ``--backend-metrics`` URL before and after the measured
run and hands both snapshots here.

- ``engine_prefix_hit_rate`` = sum of delta hits / sum of delta queries over the
  backends (tokens, vLLM's ``vllm:prefix_cache_{hits,queries}_total``).
- prefill tokens served by a backend = delta queries - delta hits (what it computed).
- ``backend_load_imbalance`` = max / mean of prefill tokens per backend. Without
  snapshots it falls back to the client's view: prompt - cached tokens per backend, where
  the responses report ``cached_tokens`` (else prompt tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.bench.metrics import (
    EngineCounters,
    RequestRecord,
    backend_key,
    counter_delta,
    load_imbalance,
    measured,
    prefix_group_affinity,
    router_stickiness,
)


@dataclass(frozen=True, slots=True)
class EngineDelta:
    """What one backend's engine counted during the measured run (tokens)."""

    queries: float  # prompt tokens looked up in the prefix cache
    hits: float  # of which found cached
    prompt_tokens: float | None  # vllm:prompt_tokens_total delta, when exported

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def prefill_tokens(self) -> float:
        return self.queries - self.hits


def engine_deltas(
    before: Mapping[str, EngineCounters | None], after: Mapping[str, EngineCounters | None]
) -> dict[str, EngineDelta]:
    """Per backend (normalised URL), the counter deltas; backends without counters are left out."""
    out: dict[str, EngineDelta] = {}
    for url, end in after.items():
        start = before.get(url)
        if start is None or end is None:
            continue
        queries = counter_delta(start.prefix_cache_queries, end.prefix_cache_queries)
        hits = counter_delta(start.prefix_cache_hits, end.prefix_cache_hits)
        assert queries is not None and hits is not None, "counters are always present"
        prompt = counter_delta(start.prompt_tokens, end.prompt_tokens)
        out[backend_key(url)] = EngineDelta(queries, hits, prompt)
    return out


def fleet_hit_rate(deltas: Mapping[str, EngineDelta]) -> float | None:
    queries = sum(d.queries for d in deltas.values())
    return sum(d.hits for d in deltas.values()) / queries if queries > 0 else None


def _client_rows(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = defaultdict(list)
    for r in measured(records):
        if not r.backend:
            continue
        key = backend_key(r.backend)
        row = rows.setdefault(key, _empty_row(key))
        row["num_requests"] += 1
        if not r.ok:
            row["num_failed"] += 1
            continue
        row["prompt_tokens"] += r.prompt_tokens
        row["output_tokens"] += r.output_tokens
        if r.cached_tokens is not None:
            row["cached_tokens"] = (row["cached_tokens"] or 0) + r.cached_tokens
        if r.ttft_s is not None:
            ttfts[key].append(r.ttft_s * 1000.0)
    for key, values in ttfts.items():
        rows[key]["mean_ttft_ms"] = float(np.mean(values))
        rows[key]["p99_ttft_ms"] = float(np.percentile(values, 99))
    return rows


def _empty_row(key: str) -> dict[str, Any]:
    return {
        "backend": key,
        "num_requests": 0,
        "num_failed": 0,
        "prompt_tokens": 0,
        "output_tokens": 0,
        "cached_tokens": None,
        "mean_ttft_ms": None,
        "p99_ttft_ms": None,
        "prefix_cache_queries": None,
        "prefix_cache_hits": None,
        "engine_prefix_hit_rate": None,
        "prefill_tokens": None,
        "engine_prompt_tokens": None,
    }


def fleet_results(
    records: Sequence[RequestRecord], deltas: Mapping[str, EngineDelta]
) -> dict[str, Any]:
    """The kvroute keys of result.json: hit rate, stickiness, imbalance, per_backend."""
    rows = _client_rows(records)
    for key, delta in deltas.items():
        row = rows.setdefault(key, _empty_row(key))
        row.update(
            prefix_cache_queries=delta.queries,
            prefix_cache_hits=delta.hits,
            engine_prefix_hit_rate=delta.hit_rate,
            prefill_tokens=delta.prefill_tokens,
            engine_prompt_tokens=delta.prompt_tokens,
        )
    if deltas:
        imbalance = load_imbalance(d.prefill_tokens for d in deltas.values())
    else:
        for row in rows.values():
            row["prefill_tokens"] = row["prompt_tokens"] - (row["cached_tokens"] or 0)
        imbalance = load_imbalance(row["prefill_tokens"] for row in rows.values())
    done = [r for r in measured(records) if r.ok]
    reported = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    return {
        "engine_prefix_hit_rate": fleet_hit_rate(deltas),
        "router_stickiness": router_stickiness(records),
        "prefix_group_affinity": prefix_group_affinity(records),
        "backend_load_imbalance": imbalance,
        "client_cached_token_rate": (
            sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None
        ),
        "per_backend": [rows[k] for k in sorted(rows)],
    }
