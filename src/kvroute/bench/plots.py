"""PNG plots of one run, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvroute.bench.metrics import RequestRecord, measured


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_ttft(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """TTFT histogram and CDF of the measured successful requests."""
    ttft_ms = np.sort([r.ttft_s * 1000 for r in measured(records) if r.ok and r.ttft_s is not None])
    fig = Figure(figsize=(10, 4))
    hist, cdf = fig.subplots(1, 2)
    if ttft_ms.size:
        hist.hist(ttft_ms, bins=min(50, max(5, ttft_ms.size // 5)), color="tab:blue")
        cdf.plot(ttft_ms, np.arange(1, ttft_ms.size + 1) / ttft_ms.size, color="tab:blue")
        for p in (50, 90, 99):
            cdf.axvline(np.percentile(ttft_ms, p), ls=":", color="grey")
            cdf.text(np.percentile(ttft_ms, p), 0.02, f"p{p}", rotation=90, fontsize=8)
    hist.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT distribution")
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.01))
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_backends(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Per backend: requests and prefill tokens served (load), and engine hit rate."""
    rows = result.get("per_backend") or []
    names = [str(r["backend"]).replace("http://", "") for r in rows]
    x = np.arange(len(rows))
    fig = Figure(figsize=(max(6, 1.2 * len(rows) + 4), 4))
    load, hits = fig.subplots(1, 2)
    prefill = [r["prefill_tokens"] or 0 for r in rows]
    load.bar(x, prefill, color="tab:orange")
    load.set(ylabel="prefill tokens served", title="Load per backend")
    for xi, r in zip(x, rows, strict=True):
        load.text(xi, 0, f"{r['num_requests']} req", ha="center", va="bottom", fontsize=8)
    rates = [(r["engine_prefix_hit_rate"] or 0) * 100 for r in rows]
    hits.bar(x, rates, color="tab:green")
    hits.set(ylabel="engine prefix hit rate (%)", title="Hit rate per backend", ylim=(0, 100))
    for ax in (load, hits):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)
