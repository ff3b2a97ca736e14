"""Plots overlaying the routers of one comparison (matplotlib Agg, no display)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvroute.bench.compare import RouterOutcome
from kvroute.bench.decisions import DecisionAnalysis
from kvroute.bench.metrics import measured


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_ttft_cdfs(outcomes: Mapping[str, RouterOutcome], path: Path, title: str = "") -> Path:
    """One TTFT CDF line per router (measured, successful requests; log x axis)."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, outcome in outcomes.items():
        if outcome.bench is None:
            continue
        ttft_ms = np.sort(
            [r.ttft_s * 1000 for r in measured(outcome.bench.records) if r.ok and r.ttft_s]
        )
        if ttft_ms.size:
            ax.plot(ttft_ms, np.arange(1, ttft_ms.size + 1) / ttft_ms.size, label=name)
    ax.axhline(0.99, ls=":", color="grey")
    ax.set(xlabel="TTFT (ms; clock in the title)", ylabel="fraction of requests", ylim=(0, 1.01))
    ax.set_xscale("log")
    ax.set_title(title.replace("; ", "\n") or "TTFT CDF per router", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bars(outcomes: Mapping[str, RouterOutcome], path: Path, title: str = "") -> Path:
    """Engine hit rate, P99 TTFT and request throughput, one bar per router."""
    done = {n: o.bench.result for n, o in outcomes.items() if o.bench is not None}
    names = list(done)
    x = np.arange(len(names))
    panels = (
        ("engine prefix hit rate (%)", "engine_prefix_hit_rate", 100.0),
        ("P99 TTFT (ms; clock in the title)", "p99_ttft_ms", 1.0),
        ("throughput (req/s)", "request_throughput", 1.0),
    )
    fig = Figure(figsize=(max(9, 1.6 * len(names) + 5), 4))
    for ax, (label, key, factor) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        values = [(done[n].get(key) or 0.0) * factor for n in names]
        ax.bar(x, values, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(label, fontsize=9)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        for xi, v in zip(x, values, strict=True):
            ax.text(xi, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    if title:
        fig.suptitle(title.replace("; ", "\n"), fontsize=9)
    return _save(fig, path)


# one colour per reason in every run's plot; diversions in red
_REASON_COLORS = {
    "prefix": "C0",
    "session": "C4",
    "new": "C2",
    "cold": "C1",
    "load": "C3",
    "retry": "C5",
}


def plot_decisions(analysis: DecisionAnalysis, path: Path, title: str = "") -> Path:
    """Share of each decision reason per time window (stacked) with the hit rate, and P50 TTFT.

    A load spiral shows as the ``load`` band widening to the right while the TTFT bars grow.
    """
    windows = analysis.timeline
    x = np.arange(len(windows))
    labels = [f"{w.start_s:.0f}-{w.end_s:.0f}" for w in windows]
    fig = Figure(figsize=(9, 6))
    mix, ttft = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    bottom = np.zeros(len(windows))
    for i, reason in enumerate(analysis.reasons):
        share = np.array([100.0 * w.decision_share.get(reason, 0.0) for w in windows])
        color = _REASON_COLORS.get(reason, f"C{6 + i}")
        mix.bar(x, share, bottom=bottom, color=color, label=reason, width=0.8)
        bottom += share
    hit = [np.nan if w.hit_rate is None else 100.0 * w.hit_rate for w in windows]
    mix.plot(x, hit, color="black", marker="o", label="engine hit rate")
    mix.set(ylabel="% of decisions / hit rate %", ylim=(0, 105))
    mix.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    trend = analysis.diversion_trend
    trend_text = "n/a" if trend is None else f"{100.0 * trend:+.1f} pp"
    heading = title.replace("; ", "\n")
    mix.set_title(f"{heading}\nload share, last window - first: {trend_text}", fontsize=9)
    p50 = [np.nan if w.p50_ttft_ms is None else w.p50_ttft_ms for w in windows]
    ttft.bar(x, p50, color="grey", width=0.8)
    ttft.set(ylabel="P50 TTFT (ms; clock in the title)", xlabel="send time window (s)")
    ttft.set_xticks(x, labels, fontsize=8)
    return _save(fig, path)
