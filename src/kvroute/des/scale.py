"""Routers against fleet size: one trace tiled so every fleet gets traffic of its shape.

For each fleet size N (a multiple of ``base_backends``), the trace is tiled N /
``base_backends`` times (independent copies, disjoint prompts, interleaved by arrival:
``MooncakeParams.tile``), so each engine sees the load it would see in the trace's own
fleet, and each router runs on it in ``kvroute simulate``. The table and the plot give
the engines' hit rate with the three ceilings, P99 TTFT and throughput per size, and how
fast the simulator went. ``scripts/des_scale.py`` is the command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.base import Workload
from kvroute.des.report import percent
from kvroute.des.simulation import Speed, simulate_router
from kvroute.engine.profiles import EngineProfile

KEYS = (
    "engine_prefix_hit_rate",
    "cache_ceiling_hit_rate",
    "pooled_lru_hit_rate",
    "belady_hit_rate",
    "median_ttft_ms",
    "p99_ttft_ms",
    "request_throughput",
    "completed",
)


@dataclass(frozen=True, slots=True)
class ScalePoint:
    """One router on one fleet size."""

    num_backends: int
    router: str
    figures: dict[str, Any]  # KEYS of its result
    speed: Speed


def tiled_trace(trace: str, overrides: Mapping[str, str], seed: int) -> Callable[[int], Workload]:
    """A workload factory: ``tile`` copies of ``trace`` with ``overrides``."""

    def make(tile: int) -> Workload:
        args = {**overrides, "tile": str(tile)}
        return make_workload("mooncake", seed=seed, overrides=args, trace_path=trace)

    return make


def run_scale(
    make: Callable[[int], Workload],
    profile: EngineProfile,
    sizes: Sequence[int],
    routers: Sequence[str],
    *,
    base_backends: int = 8,
    copies: int | None = None,
    on_point: Callable[[ScalePoint], None] | None = None,
) -> list[ScalePoint]:
    """Each router on each size; the trace tiled size / ``base_backends`` times, or
    ``copies`` times whatever the size."""
    points = []
    for n in sizes:
        if n % base_backends:
            raise ValueError(f"fleet size {n} is not a multiple of {base_backends}")
        for router in routers:
            workload = make(copies or n // base_backends)
            bench, speed = simulate_router(
                parse_router(router), profile, n, workload, default_load(workload), keep_itl=False
            )
            point = ScalePoint(n, router, {k: bench.result.get(k) for k in KEYS}, speed)
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def format_points(points: Sequence[ScalePoint]) -> str:
    head = (
        "| backends | router | engine hit | infinite | pooled LRU | Belady | hit / Belady | "
        "P50 TTFT ms | P99 TTFT ms | req/s | requests | sim wall s | x real time | sim req/s |"
    )
    lines = [head, "|" + "---|" * 14]
    for p in points:
        f, s = p.figures, p.speed
        share = (
            f"{f['engine_prefix_hit_rate'] / f['belady_hit_rate']:.2f}"
            if f["engine_prefix_hit_rate"] is not None and f["belady_hit_rate"]
            else "n/a"
        )
        lines.append(
            f"| {p.num_backends} | {p.router} | {percent(f['engine_prefix_hit_rate'])} | "
            f"{percent(f['cache_ceiling_hit_rate'])} | {percent(f['pooled_lru_hit_rate'])} | "
            f"{percent(f['belady_hit_rate'])} | {share} | {f['median_ttft_ms']:.0f} | "
            f"{f['p99_ttft_ms']:.0f} | {f['request_throughput']:.2f} | {f['completed']} | "
            f"{s.wall_s:.1f} | {s.x_real_time:.0f} | {s.requests_per_s:.0f} |"
        )
    return "\n".join(lines)


def plot_points(points: Sequence[ScalePoint], path: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    hit_ax, p99_ax = fig.subplots(1, 2)
    routers = list(dict.fromkeys(p.router for p in points))
    for router in routers:
        mine = [p for p in points if p.router == router]
        xs = [p.num_backends for p in mine]
        hits = [100 * (p.figures["engine_prefix_hit_rate"] or 0) for p in mine]
        hit_ax.plot(xs, hits, marker="o", label=router)
        p99_ax.plot(xs, [p.figures["p99_ttft_ms"] for p in mine], marker="o", label=router)
    first = [p for p in points if p.router == routers[0]]
    xs = [p.num_backends for p in first]
    for key, label, style in (
        ("cache_ceiling_hit_rate", "infinite cache", ":"),
        ("pooled_lru_hit_rate", "pooled LRU", "--"),
        ("belady_hit_rate", "Belady (pooled)", "-."),
    ):
        ys = [100 * (p.figures[key] or 0) for p in first]
        hit_ax.plot(xs, ys, ls=style, color="grey", label=label)
    for ax in (hit_ax, p99_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("backends")
        ax.legend(fontsize=7)
    hit_ax.set_ylabel("engine prefix-cache hit rate (%)")
    p99_ax.set_ylabel("P99 TTFT (ms, engine time)")
    p99_ax.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
