"""Reports of one run: a console summary laid out like ``vllm bench serve``, result.json,
per-request records (JSONL) and PNG plots."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvroute.bench.metrics import RequestRecord
from kvroute.bench.runner import BenchResult

BANNER = "{s:{c}^{n}}"
MAX_REASON_CHARS = 200  # a failure reason on the console is cut here
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _line(label: str, value: Any) -> str:
    if value is None:
        return f"{label:<40} {'n/a':<10}"
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def format_summary(result: dict[str, Any]) -> str:
    """The console summary: vLLM's lines, then kvroute's locality lines and backends."""
    load = result.get("config", {}).get("load", {})
    lines = [BANNER.format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [
        _line("Successful requests:", result["completed"]),
        _line("Failed requests:", result["failed"]),
        _line("Load mode:", load.get("mode")),
    ]
    if load.get("mode") == "open":
        lines.append(_line("Request rate configured (RPS):", ",".join(map(str, load["rates"]))))
    if load.get("max_concurrency"):
        lines.append(_line("Maximum request concurrency:", load["max_concurrency"]))
    lines += [
        _line("Benchmark duration (s):", result["duration"]),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", result["request_throughput"]),
        _line("Output token throughput (tok/s):", result["output_throughput"]),
        _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        _line("Peak concurrent requests:", result["max_concurrent_requests"]),
        _line("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for key, short, title in _SECTIONS:
        lines.append(BANNER.format(s=f" {title} ", n=50, c="-"))
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{key}_ms"]))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{key}_ms"]))
        lines.append(_line(f"P99 {short} (ms):", result[f"p99_{key}_ms"]))
    lines.append(BANNER.format(s=" KV-cache locality ", n=50, c="-"))
    lines += [
        _line("Engine prefix hit rate (%):", _pct(result.get("engine_prefix_hit_rate"))),
        _line("Infinite-cache ceiling (%):", _pct(result.get("cache_ceiling_hit_rate"))),
        _line("Router stickiness, Ranvier (%):", _pct(result.get("router_stickiness"))),
        _line("Backend load imbalance (max/mean):", result.get("backend_load_imbalance")),
    ]
    lines.append("=" * 50)
    lines += _backend_lines(result.get("per_backend") or [])
    return "\n".join(lines)


def nothing_measured(bench: BenchResult) -> str | None:
    """Why a run measured no request (its table is all n/a), or None when it measured one."""
    if bench.result["completed"] or bench.result["failed"]:
        return None
    warmup = sum(r.warmup for r in bench.records)
    if warmup:
        return (
            f"no request was measured: the {warmup} warm-up requests (--num-warmup) were all"
            " the workload and the run's bound let it send"
        )
    return "no request was measured: the run sent none (see --duration and the workload)"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _backend_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = [f"{'backend':<32} {'requests':>8} {'hit %':>7} {'prefill tok':>12} {'TTFT ms':>9}"]
    for r in rows:
        hit = _pct(r["engine_prefix_hit_rate"])
        out.append(
            f"{str(r['backend'])[-32:]:<32} {r['num_requests']:>8} {_fmt(hit, '.1f'):>7} "
            f"{_fmt(r['prefill_tokens'], '.0f'):>12} {_fmt(r['mean_ttft_ms'], '.1f'):>9}"
        )
    return out


def format_failures(records: Sequence[RequestRecord], top: int = 3) -> str:
    """The ``top`` most common reasons requests failed (warm-up included), with their
    counts, most common first; empty when none failed."""
    reasons = Counter(
        " ".join((r.error or "failed").split())[:MAX_REASON_CHARS] for r in records if not r.ok
    )
    if not reasons:
        return ""
    lines = [f"Failed requests by reason ({sum(reasons.values())} in all, warm-up included):"]
    lines += [f"{n:>8} x {reason}" for reason, n in reasons.most_common(top)]
    if len(reasons) > top:
        lines.append(f"{'':>8}   and {len(reasons) - top} other reasons")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as None and tuples as lists (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_outputs(
    bench: BenchResult, out_dir: str | Path, *, plots: bool = True
) -> dict[str, Path]:
    """Write result.json, records.jsonl and (with ``plots``) ttft.png, backends.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"result": out / "result.json", "records": out / "records.jsonl"}
    paths["result"].write_text(json.dumps(jsonable(bench.result), indent=2, allow_nan=False) + "\n")
    # msgspec writes a dataclass as it is, non-finite floats as null (as ``jsonable``):
    # 25x json.dumps(asdict(...)), whose deep copy took seconds on a long trace's ITLs
    encode = msgspec.json.Encoder().encode
    with paths["records"].open("wb") as f:
        for record in bench.records:
            f.write(encode(record) + b"\n")
    if plots:
        from kvroute.bench.plots import plot_backends, plot_ttft

        title = f"{bench.result['workload']['name']} / {bench.result.get('router') or 'target'}"
        paths["ttft_plot"] = plot_ttft(bench.records, out / "ttft.png", title)
        paths["backends_plot"] = plot_backends(bench.result, out / "backends.png", title)
    return paths
