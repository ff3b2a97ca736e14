"""Benchmark metrics: vLLM ``bench serve`` definitions plus the fleet-level ones kvroute adds.

Pure: records in, numbers out (the load generator measures, this module only computes).

vLLM definitions (``vllm/benchmarks/serve.py``), in milliseconds in the output:

- TTFT: send to first streamed token, per request.
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: every gap between successive token chunks of every request, pooled in one list.
- E2EL: send to end of stream.
- statistics: mean, median, std and ``np.percentile`` (linear interpolation); 0 when
  there is no sample, as vLLM prints.
- throughput: completed / duration, output tokens / duration, (input + output) / duration.

Added: ``engine_prefix_hit_rate`` (fleet delta hits / delta queries of the engines'
own counters, tokens), ``router_stickiness`` (Ranvier's client-side metric),
``backend_load_imbalance`` (max / mean prefill tokens per backend).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.common.vllm_metrics import parse_vllm_metrics

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client measured for one request."""

    request_id: str  # the spec's id
    prefix_group: str  # the spec's shared-prefix label
    session_id: str | None  # multi-turn conversation, or None
    turn: int  # position in its session
    start_s: float  # send time, seconds from the run start (negative for warm-up)
    ok: bool  # completed with status 200 and no error in the stream
    ttft_s: float | None  # first token; None when no token arrived
    itl_s: tuple[float, ...]  # gaps between successive token chunks
    e2e_s: float | None  # end of stream (or of the failure)
    prompt_tokens: int  # usage.prompt_tokens, else the spec's count
    output_tokens: int  # usage.completion_tokens, else the number of token chunks
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when reported
    backend: str | None  # x-kvroute-backend, or the target itself when it is one engine
    decision: str | None = None  # x-kvroute-decision, when the target is a kvroute router
    # x-kvroute-predicted-cached-tokens: the hit the router expected (kvroute routers only)
    predicted_cached_tokens: int | None = None
    # x-kvroute-left-cached-tokens: the hit predicted on the holder it was moved away from
    # (0 when the answer has none: not moved; None when the target is not a kvroute router)
    left_cached_tokens: int | None = None
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None  # why it failed
    warmup: bool = False  # sent before the measured run: excluded from metrics

    @property
    def tpot_s(self) -> float | None:
        """vLLM TPOT; None for requests with fewer than two output tokens."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_{name}_ms`` of ``values_s`` (seconds in, ms out)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(ms)),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def measured(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """Records of the measured run (warm-up left out)."""
    return [r for r in records if not r.warmup]


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (sweep over send .. end intervals; an end and a
    send at the same time: the end first)."""
    timed = [r for r in records if r.e2e_s is not None]
    if not timed:
        return 0
    starts = np.array([r.start_s for r in timed])
    ends = starts + np.array([r.e2e_s for r in timed])
    times = np.concatenate((starts, ends))
    steps = np.concatenate((np.ones(len(timed), np.int64), np.full(len(timed), -1, np.int64)))
    levels = np.cumsum(steps[np.lexsort((steps, times))])
    return max(0, int(levels.max()))


def peak_output_throughput(records: Sequence[RequestRecord]) -> float:
    """Most token chunks received in one wall-clock second (vLLM's 1-s buckets).

    Each record's chunk times are its first token's plus the gaps, added one by one
    (``np.cumsum`` adds in order, as a running sum would)."""
    times = [
        np.cumsum((r.start_s + r.ttft_s, *r.itl_s))
        for r in records
        if r.ok and r.ttft_s is not None
    ]
    if not times:
        return 0.0
    seconds = np.concatenate(times).astype(np.int64)  # int(): towards zero
    return float(np.bincount(seconds - seconds.min()).max())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    itl_s: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The vLLM ``bench serve`` result keys for the measured records; ``itl_s``: the
    inter-token gaps when the caller pooled them already (else taken from the records)."""
    runs = measured(records)
    done = [r for r in runs if r.ok]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(runs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_output_throughput(done),
        "max_concurrent_requests": peak_concurrency(runs),
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": itl_s if itl_s is not None else [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for name in LATENCY_METRICS:
        out.update(latency_stats(name, series[name]))
    return out


def router_stickiness(records: Sequence[RequestRecord]) -> float | None:
    """Ranvier's client-side "cache hit rate" (docs/workloads.md), for comparison only.

    A request counts as a hit when the backend that served it is the backend that last
    served the same key (here its ``prefix_group``); the first sighting of a key and any
    change of backend are misses. Requests are taken in the order their responses
    started (send time + TTFT), as Locust updates its map on the response. Round-robin
    scores about 1/N by construction. It measures routing consistency, not the engines'
    cache: ``engine_prefix_hit_rate`` is the honest number. None without backends.
    """
    served = [r for r in measured(records) if r.ok and r.backend]
    served.sort(key=lambda r: r.start_s + (r.ttft_s if r.ttft_s is not None else r.e2e_s or 0))
    last: dict[str, str] = {}
    hits = 0
    for r in served:
        assert r.backend is not None, "filtered above"
        hits += last.get(r.prefix_group) == r.backend
        last[r.prefix_group] = r.backend
    return hits / len(served) if served else None


def prefix_group_affinity(records: Sequence[RequestRecord]) -> float | None:
    """Share of requests that went to their prefix group's most-used backend."""
    per_group: dict[str, Counter[str]] = defaultdict(Counter)
    for r in measured(records):
        if r.ok and r.backend:
            per_group[r.prefix_group][r.backend] += 1
    total = sum(sum(c.values()) for c in per_group.values())
    top = sum(max(c.values()) for c in per_group.values())
    return top / total if total else None


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Cumulative engine counters scraped from one backend's /metrics (tokens)."""

    prefix_cache_queries: float  # vllm:prefix_cache_queries_total, summed over engines
    prefix_cache_hits: float  # vllm:prefix_cache_hits_total
    prompt_tokens: float | None  # vllm:prompt_tokens_total, when exported


def parse_engine_counters(text: str) -> EngineCounters | None:
    """The prefix-cache counters of a vLLM /metrics page; None when it has none.
    ValueError when the page is not Prometheus text."""
    m = parse_vllm_metrics(text)
    if m.prefix_cache_queries is None or m.prefix_cache_hits is None:
        return None
    return EngineCounters(m.prefix_cache_queries, m.prefix_cache_hits, m.prompt_tokens)


def counter_delta(before: float | None, after: float | None) -> float | None:
    """after - before; a counter that went down was reset, so all of ``after`` is new."""
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def backend_key(url: str) -> str:
    """One spelling per backend: metrics URLs and x-kvroute-backend values match."""
    url = url.strip().rstrip("/")
    return url[: -len("/metrics")] if url.endswith("/metrics") else url


def load_imbalance(values: Iterable[float]) -> float | None:
    """max / mean; None when there is nothing or nothing was served."""
    vals = list(values)
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else None
