"""When does prefix-aware routing pay? Model size x shared-prefix length x router.

The seed article's qualitative claims: the gain of cache-aware routing over round-robin
grows with the model (a bigger model's prefill costs more, so a hit saves more) and with
the length of the shared context; small models and short prompts gain little. This
sweep asks the simulator: for each engine profile and each shared-prefix length, the
``gsp`` workload (64 groups of a shared system prompt of that length, 128-token
questions, 256 output tokens) runs on the same fleet under each router, as a closed
loop with ``users_per_backend`` users per replica and no think time (so throughput is
the fleet's capacity and TTFT includes its queues), and the result is kvroute's P99
TTFT and throughput against round-robin's. ``scripts/des_sweep.py`` is the command; it
prints the table and draws the two heat maps.

A cell whose prompt does not fit the profile's context (prefix + question + output >
``max_model_len``) is left out rather than truncated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.shared_prefix import GspParams
from kvroute.des.simulation import simulate_router
from kvroute.engine.profiles import EngineProfile

KEYS = ("engine_prefix_hit_rate", "median_ttft_ms", "p99_ttft_ms", "request_throughput")


@dataclass(frozen=True, slots=True)
class SweepCell:
    """One router on one (profile, prefix length)."""

    profile: str
    prefix_tokens: int
    router: str
    figures: dict[str, Any]  # KEYS of its result


def fits(profile: EngineProfile, prefix_tokens: int) -> bool:
    p = GspParams()
    return prefix_tokens + p.question_tokens + p.output_tokens <= profile.max_model_len


def run_sweep(
    profiles: Sequence[EngineProfile],
    prefix_tokens: Sequence[int],
    routers: Sequence[str],
    *,
    num_backends: int = 8,
    users_per_backend: int = 4,
    duration_s: float = 120.0,
    num_warmup: int = 0,
    seed: int = 0,
    on_cell: Callable[[SweepCell], None] | None = None,
) -> list[SweepCell]:
    """Every router on every (profile, length) that fits."""
    cells = []
    for profile in profiles:
        for length in prefix_tokens:
            if not fits(profile, length):
                continue
            for router in routers:
                overrides = {"system_prompt_tokens": str(length)}
                workload = make_workload("gsp", seed=seed, overrides=overrides)
                load = default_load(
                    workload,
                    mode="closed",
                    num_users=users_per_backend * num_backends,
                    think_time_s=(0.0, 0.0),
                    duration_s=duration_s,
                    num_warmup=num_warmup,
                )
                bench, _ = simulate_router(
                    parse_router(router), profile, num_backends, workload, load, keep_itl=False
                )
                cell = SweepCell(
                    profile.name, length, router, {k: bench.result.get(k) for k in KEYS}
                )
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def gains(cells: Sequence[SweepCell], router: str, baseline: str) -> dict[tuple[str, int], Any]:
    """(profile, length) -> (P99 TTFT baseline / router, throughput router / baseline)."""
    by = {(c.profile, c.prefix_tokens, c.router): c.figures for c in cells}
    out: dict[tuple[str, int], Any] = {}
    for (profile, length, name), mine in by.items():
        base = by.get((profile, length, baseline))
        if name != router or base is None:
            continue
        p99 = base["p99_ttft_ms"] / mine["p99_ttft_ms"] if mine["p99_ttft_ms"] else None
        tput = (
            mine["request_throughput"] / base["request_throughput"]
            if base["request_throughput"]
            else None
        )
        out[(profile, length)] = (p99, tput)
    return out


def format_cells(cells: Sequence[SweepCell], router: str, baseline: str) -> str:
    """A markdown table: each cell's figures and the router's gains over the baseline."""
    g = gains(cells, router, baseline)
    lines = [
        "| profile | prefix tokens | router | engine hit | P50 TTFT ms | P99 TTFT ms | req/s "
        f"| P99 {baseline} / {router} | req/s {router} / {baseline} |",
        "|" + "---|" * 9,
    ]
    for c in cells:
        f = c.figures
        p99, tput = g.get((c.profile, c.prefix_tokens), (None, None))
        mine = c.router == router
        lines.append(
            f"| {c.profile} | {c.prefix_tokens} | {c.router} | "
            f"{100 * (f['engine_prefix_hit_rate'] or 0):.1f} % | {f['median_ttft_ms']:.0f} | "
            f"{f['p99_ttft_ms']:.0f} | {f['request_throughput']:.2f} | "
            f"{f'{p99:.2f}x' if mine and p99 else ''} | {f'{tput:.2f}x' if mine and tput else ''} |"
        )
    return "\n".join(lines)


def plot_gains(
    cells: Sequence[SweepCell], router: str, baseline: str, path: Path, title: str
) -> Path:
    """Two heat maps, profiles x prefix lengths: P99 TTFT ratio and throughput ratio."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    g = gains(cells, router, baseline)
    profiles = list(dict.fromkeys(c.profile for c in cells))
    lengths = sorted({c.prefix_tokens for c in cells})
    fig = Figure(figsize=(12, 0.6 * len(profiles) + 2.5))
    axes = fig.subplots(1, 2)
    names = (f"P99 TTFT: {baseline} / {router}", f"throughput: {router} / {baseline}")
    for k, (ax, name) in enumerate(zip(axes, names, strict=True)):
        grid = np.full((len(profiles), len(lengths)), np.nan)
        for (profile, length), ratios in g.items():
            if ratios[k] is not None:
                grid[profiles.index(profile), lengths.index(length)] = ratios[k]
        image = ax.imshow(np.log2(grid), cmap="RdYlGn", vmin=-3, vmax=3, aspect="auto")
        for i in range(len(profiles)):
            for j in range(len(lengths)):
                text = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}x"
                ax.text(j, i, text, ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(profiles)), profiles, fontsize=8)
        ax.set_xlabel("shared-prefix tokens")
        ax.set_title(name, fontsize=9)
        fig.colorbar(image, ax=ax, label="log2 gain")
    fig.suptitle(title, fontsize=9)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
