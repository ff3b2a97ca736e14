"""The comparison's outputs: one side-by-side table, compare.json, and overlay plots.

Below the table, each kvroute router's decision analysis (``bench.decisions``): its
decision mix over time, what each kind of decision cost, per backend. ``load_compare``
reads a written comparison back, so ``kvroute compare --analyze DIR`` can print it again.

Ratios are taken against round-robin (``BASELINE``): relative change in % for latencies,
throughputs and imbalance; a difference in percentage points (pp) for the two rates.
Times are what the client measured, in wall-clock milliseconds; with ``--speedup X``
the engines ran X times faster than real time, so engine time = X x wall (the header
says so).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.compare import BASELINE, RouterOutcome, safe_name
from kvroute.bench.decisions import DEFAULT_WINDOWS, analyze, format_analysis
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.procs import one_line
from kvroute.bench.report import jsonable, write_outputs
from kvroute.bench.runner import BenchResult


@dataclass(frozen=True, slots=True)
class Column:
    """One numeric column of the table."""

    title: str  # header text
    key: str  # result.json key
    kind: str  # "rate" (0..1, shown in %, compared in pp), "rel" (compared in %), "count"
    spec: str  # format of the value
    versus_base: bool = True  # False: no change vs the baseline (not the router's doing)


COLUMNS = (
    Column("engine hit", "engine_prefix_hit_rate", "rate", ".1f"),
    # infinite-cache hit rate of the requests this run sent (bench/ceiling.py)
    Column("ceiling", "cache_ceiling_hit_rate", "rate", ".1f", versus_base=False),
    Column("stickiness", "router_stickiness", "rate", ".1f"),
    Column("P50 TTFT ms", "median_ttft_ms", "rel", ".0f"),
    Column("P99 TTFT ms", "p99_ttft_ms", "rel", ".0f"),
    Column("req/s", "request_throughput", "rel", ".2f"),
    Column("out tok/s", "output_throughput", "rel", ".0f"),
    Column("imbalance", "backend_load_imbalance", "rel", ".2f"),
    Column("failed", "failed", "count", "d"),
)


def change(value: float | None, base: float | None, kind: str) -> str:
    """``value`` against ``base``: "+85.4 pp" for rates, "-85 %" otherwise; "" if undefined."""
    if value is None or base is None or kind == "count":
        return ""
    if kind == "rate":
        return f"{100.0 * (value - base):+.1f} pp"
    if base == 0:
        return ""
    return f"{100.0 * (value - base) / base:+.0f} %"


# figures of the completed requests: none when nothing completed (their 0 is no figure)
_OF_COMPLETED = frozenset({"median_ttft_ms", "p99_ttft_ms"})


def _cell(result: Mapping[str, Any], base: Mapping[str, Any] | None, col: Column) -> str:
    value = result.get(col.key)
    if value is None or (col.key in _OF_COMPLETED and result.get("completed") == 0):
        return "n/a"
    shown = 100.0 * value if col.kind == "rate" else value
    text = format(shown, col.spec) + (" %" if col.kind == "rate" else "")
    if base is not None and base is not result and col.versus_base:
        delta = change(value, base.get(col.key), col.kind)
        if delta:
            text += f" ({delta})"
    return text


def table_rows(outcomes: Mapping[str, RouterOutcome]) -> list[list[str]]:
    """Header row, then one row per router (skipped and failed ones say why)."""
    base_outcome = outcomes.get(BASELINE)
    base = base_outcome.bench.result if base_outcome and base_outcome.bench else None
    rows = [["router", *(c.title for c in COLUMNS)]]
    for name, outcome in outcomes.items():
        if outcome.bench is not None:
            rows.append([name, *(_cell(outcome.bench.result, base, c) for c in COLUMNS)])
        else:
            why = f"skipped: {outcome.skipped}" if outcome.skipped else f"failed: {outcome.error}"
            rows.append([name, one_line(why)])
    return rows


def format_table(outcomes: Mapping[str, RouterOutcome], header: str = "") -> str:
    """The side-by-side table as plain text (also written to compare.txt)."""
    rows = table_rows(outcomes)
    full = [r for r in rows if len(r) == len(rows[0])]
    widths = [max(len(r[i]) for r in full) for i in range(len(rows[0]))]
    widths[0] = max(len(r[0]) for r in rows)
    lines = [header] if header else []
    for row in rows:
        if len(row) == len(widths):
            cells = [row[0].ljust(widths[0])]
            cells += [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join(cells))
        else:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        if row is rows[0]:
            lines.append("-" * len(lines[-1]))
    if BASELINE in outcomes:
        lines.append(f"(in brackets: change vs {BASELINE}; pp = percentage points)")
    return "\n".join(lines)


def describe_run(config: Mapping[str, Any]) -> str:
    """The table's header line from a result's ``config`` and ``workload``."""
    speedup = config.get("speedup", 1.0)
    if config.get("target") == "kvroute simulate":
        clock = "simulated: times are engine time"
    elif speedup == 1:
        clock = "times are wall-clock"
    else:
        clock = (
            f"engines at speedup {speedup:g}: times are wall-clock (engine time = {speedup:g} x)"
        )
    load = config.get("load", {})
    users = f", {load['num_users']} users" if load.get("mode") == "closed" else ""
    rates = [r for r in load.get("rates") or () if isinstance(r, (int, float))]
    if load.get("mode") == "open" and rates:
        users = f", {'/'.join(format(r, 'g') for r in rates)} req/s offered"
        if load.get("max_concurrency"):
            users += f" (at most {load['max_concurrency']} in flight)"
    return (
        f"{config.get('num_backends')} x {config.get('profile')}{users}, "
        f"seed {config.get('seed')}; {clock}"
    )


def header_for(outcomes: Mapping[str, RouterOutcome]) -> str:
    for outcome in outcomes.values():
        if outcome.bench is not None:
            result = outcome.bench.result
            return f"{result['workload']['name']} on {describe_run(result['config'])}"
    return ""


def format_analyses(
    outcomes: Mapping[str, RouterOutcome], num_windows: int = DEFAULT_WINDOWS
) -> str:
    """The decision analysis of every router whose records carry decisions ("" if none)."""
    parts = []
    for name, outcome in outcomes.items():
        if outcome.bench is not None:
            analysis = analyze(outcome.bench.records, num_windows)
            if analysis is not None:
                parts.append(format_analysis(name, analysis))
    return "\n\n".join(parts)


def write_compare(
    outcomes: Mapping[str, RouterOutcome], out_dir: str | Path, *, plots: bool = True
) -> dict[str, Path]:
    """compare.json, compare.txt, each router's own outputs in a subfolder, and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"compare": out / "compare.json", "table": out / "compare.txt"}
    data = {name: o.to_json() for name, o in outcomes.items()}
    paths["compare"].write_text(json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")
    table = format_table(outcomes, header_for(outcomes))
    analyses = format_analyses(outcomes)
    paths["table"].write_text(table + (f"\n\n{analyses}" if analyses else "") + "\n")
    for name, outcome in outcomes.items():
        if outcome.bench is not None:
            write_outputs(outcome.bench, out / safe_name(name), plots=plots)
    if plots and any(o.bench is not None for o in outcomes.values()):
        from kvroute.bench.compare_plots import plot_bars, plot_decisions, plot_ttft_cdfs

        title = header_for(outcomes)
        paths["ttft_cdf"] = plot_ttft_cdfs(outcomes, out / "compare_ttft_cdf.png", title)
        paths["bars"] = plot_bars(outcomes, out / "compare_bars.png", title)
        for name, outcome in outcomes.items():
            analysis = analyze(outcome.bench.records) if outcome.bench is not None else None
            if analysis is not None:
                path = out / safe_name(name) / "decisions.png"
                paths[f"decisions:{name}"] = plot_decisions(analysis, path, f"{name}: {title}")
    return paths


def read_records(path: Path) -> list[RequestRecord]:
    """records.jsonl as written by ``write_outputs`` (fields this version lacks are dropped)."""
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            data = {k: v for k, v in json.loads(line).items() if k in names}
            data["itl_s"] = tuple(data.get("itl_s") or ())
            records.append(RequestRecord(**data))
    return records


def load_compare(out_dir: str | Path) -> dict[str, RouterOutcome]:
    """A written comparison read back: compare.json and each router's records.jsonl."""
    out = Path(out_dir)
    data = json.loads((out / "compare.json").read_text())
    outcomes = {}
    for name, result in data.items():
        if "skipped" in result:
            outcomes[name] = RouterOutcome(name, skipped=result["skipped"])
        elif "error" in result:
            outcomes[name] = RouterOutcome(name, error=result["error"])
        else:
            records_path = out / safe_name(name) / "records.jsonl"
            records = read_records(records_path) if records_path.exists() else []
            outcomes[name] = RouterOutcome(name, BenchResult(result, records))
    return outcomes
