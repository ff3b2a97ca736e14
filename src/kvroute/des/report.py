"""What ``kvroute simulate`` prints beside the comparison table: ceilings and speed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.bench.compare import RouterOutcome
from kvroute.common.text_table import text_table
from kvroute.des.simulation import Speed

CEILINGS = (
    ("infinite", "cache_ceiling_hit_rate"),
    ("pooled LRU", "pooled_lru_hit_rate"),
    ("Belady", "belady_hit_rate"),
)


def percent(x: float | None) -> str:
    """A 0..1 rate as "12.3 %" ("n/a" for None)."""
    return "n/a" if x is None else f"{100.0 * x:.1f} %"


def _share(hit: float | None, ceiling: float | None) -> str:
    if hit is None or not ceiling:
        return "n/a"
    return f"{hit / ceiling:.2f}"


def format_ceilings(outcomes: Mapping[str, RouterOutcome]) -> str:
    """Each router's engine hit rate beside the three ceilings and as a fraction of each."""
    rows = [["router", "engine hit", *(name for name, _ in CEILINGS)]]
    rows[0] += [f"of {name}" for name, _ in CEILINGS]
    for name, outcome in outcomes.items():
        if outcome.bench is None:
            continue
        r: dict[str, Any] = outcome.bench.result
        hit = r.get("engine_prefix_hit_rate")
        ceilings = [r.get(key) for _, key in CEILINGS]
        rows.append(
            [name, percent(hit), *map(percent, ceilings), *(_share(hit, c) for c in ceilings)]
        )
    if len(rows) == 1:
        return ""
    return (
        "Ceilings over the prompts each run sent (pooled: one cache of the whole fleet's "
        "KV blocks):\n" + text_table(rows)
    )


def format_reuse_regime(outcomes: Mapping[str, RouterOutcome]) -> str:
    """Per router, the share of requests routed while the fleet's reuse regime said
    "spread" (kvroute's policy then spreads new prompts behind a shared head evenly),
    "past" or nothing clear, and the late : ghost votes at the end (core/reuse_regime.py)."""
    rows = [["router", "spread", "past residency", "undecided", "late : ghost at end"]]
    for name, outcome in outcomes.items():
        if outcome.bench is None:
            continue
        result = outcome.bench.result
        regime = result.get("simulation", {}).get("reuse_regime")
        if not regime or result.get("config", {}).get("router_policy") != "prefix":
            continue  # measured for every router, used by kvroute's policy only
        counts = [regime[k] for k in ("requests_spread", "requests_past_residency",
                                      "requests_undecided")]  # fmt: skip
        total = sum(counts) or 1
        late, ghost = regime["late_at_end"], regime["ghost_at_end"]
        shares = [f"{100 * c / total:.0f} %" for c in counts]
        rows.append([name, *shares, f"{late:.0f} : {ghost:.0f}"])
    if len(rows) == 1:
        return ""
    return (
        "Reuse regime (requests routed under each verdict; kvroute's policy spreads new\n"
        'prompts behind a shared head only under "spread"):\n' + text_table(rows)
    )


def format_speed(speeds: Mapping[str, Speed]) -> str:
    rows = [["router", "wall s", "engine s", "x real time", "requests", "sim req/s"]]
    for name, s in speeds.items():
        rows.append(
            [
                name,
                f"{s.wall_s:.1f}",
                f"{s.engine_time_s:.0f}",
                f"{s.x_real_time:.0f}",
                str(s.num_requests),
                f"{s.requests_per_s:.0f}",
            ]
        )
    return "Simulator speed (this machine):\n" + text_table(rows)
