#!/usr/bin/env python3
"""Every router on every workload and fleet size in the simulator, several seeds.

    python scripts/des_table.py --sizes 8,64 --seeds 5 --out runs/table
    python scripts/des_table.py --sizes 1024 --seeds 1 --workloads gsp,zipf-hot --out runs/t1k

Each workload runs at its 8-replica shape (BENCHMARKS.md's settings) tiled size / 8
times (``--workload-arg tile=N``: independent copies, load x N), so every fleet size sees
the same traffic per replica. Cells are mean over seeds with the range; hit rates are
the engines' counters, also as a share of the pooled-LRU and Belady ceilings (``-`` with
``--no-ceilings``, whose cells skip the ceilings' prompt log: 8 bytes per prompt block
sent, about half the peak memory of an agentic run). The best
hit rate and P99 of each (workload, size) are marked. Results are appended to
``cells.jsonl`` as they come (a long run keeps what it finished, and a rerun with the
same ``--out`` only runs the cells missing there); ``table.md`` is rewritten after each.
``--jobs N`` runs N cells at once, one process each (a cell is one simulation, a core's
work; the cells do not depend on each other, so the figures are the same).

A router written ``NAME@FILE`` runs with the kvroute YAML in FILE (``kvroute simulate
--router-config``: fleet, cost and policy settings) and keeps the whole string as its
row's name, so a setting can be measured beside the default in one table:

    python scripts/des_table.py --sizes 8 --routers kvroute,kvroute@trial.yaml --out runs/trial
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.des.simulation import simulate_router
from kvroute.sim.profiles import get_profile

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
C13 = ("codellama-13b-a100-40g", 8)
MOONCAKE_SLICE = {"max_requests": "1000", "input_scale": "0.1", "output_cap": "64"}
# name -> (workload, overrides, load overrides, (profile, replicas per copy))
WORKLOADS: dict[str, tuple[str, dict[str, str], dict[str, Any], tuple[str, int]]] = {
    "mooncake": ("mooncake", MOONCAKE_SLICE, {}, C13),
    "gsp": ("gsp", {}, {"duration_s": 360.0}, C13),
    "zipf-hot": ("zipf-hot", {}, {"duration_s": 360.0}, C13),
    "ranvier-stress": ("ranvier-stress", {}, {"duration_s": 600.0, "num_warmup": 60}, C13),
    "b2b": ("b2b", {}, {"duration_s": 600.0, "rates": (1.0,)}, ("llama-3.1-8b-a100", 4)),
    "multiturn": ("multiturn", {}, {"duration_s": 360.0}, C13),
    "agentic": ("agentic", {}, {"duration_s": 720.0}, ("llama-3.1-8b-a100", 4)),
}
ROUTERS = (
    "round_robin,kvroute,sglang-cache-aware,llm-d,llm-d-no-hit-lru,dynamo,aibrix-dualmap,chwbl"
)


def run_cell(
    workload: str,
    size: int,
    router: str,
    seed: int,
    duration_s: float | None = None,
    ceilings: bool = True,
) -> dict[str, Any]:
    name, overrides, load_overrides, (profile, base) = WORKLOADS[workload]
    if size % base:
        raise ValueError(f"{workload}: fleet size {size} is not a multiple of {base}")
    copies = size // base
    trace = str(TRACE) if name == "mooncake" else None
    w = make_workload(name, seed=seed, overrides={**overrides, "tile": str(copies)},
                      trace_path=trace)  # fmt: skip
    fields = dict(load_overrides)
    if duration_s is not None and "duration_s" in fields:
        fields["duration_s"] = duration_s
    if "rates" in fields:
        fields["rates"] = tuple(r * copies for r in fields["rates"])
    load = default_load(w, seed=seed, **fields)
    kind, _, config = router.partition("@")
    bench, speed = simulate_router(parse_router(kind), get_profile(profile), size, w, load,
                                   keep_itl=False, compute_ceilings=ceilings,
                                   router_config=config or None)  # fmt: skip
    r = bench.result
    keys = ("engine_prefix_hit_rate", "pooled_lru_hit_rate", "belady_hit_rate",
            "cache_ceiling_hit_rate", "median_ttft_ms", "p99_ttft_ms", "request_throughput",
            "completed", "failed")  # fmt: skip
    return {"workload": workload, "size": size, "router": router, "seed": seed,
            "wall_s": speed.wall_s, **{k: r.get(k) for k in keys}}  # fmt: skip


def _timed_cell(
    workload: str, size: int, router: str, seed: int, duration_s: float | None, ceilings: bool
) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    cell = run_cell(workload, size, router, seed, duration_s, ceilings)
    return cell, time.perf_counter() - t0


def _mean(cells: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    xs = [c[key] or 0.0 for c in cells]
    return statistics.mean(xs), min(xs), max(xs)


def _of(hit: float, ceiling: float) -> str:
    return f"{hit / ceiling:.2f}" if ceiling else "-"  # 0: not computed (--no-ceilings)


def format_table(cells: list[dict[str, Any]]) -> str:
    """One row per (workload, size, router); ``**`` on the best hit and the best P99."""
    lines = [
        "| workload | backends | router | engine hit % (range) | of pooled LRU | of Belady "
        "| P50 TTFT ms | P99 TTFT ms (range) | req/s | seeds |",
        "|" + "---|" * 10,
    ]
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for c in cells:
        groups.setdefault((c["workload"], c["size"]), {}).setdefault(c["router"], []).append(c)
    for (workload, size), by_router in groups.items():
        hits = {r: _mean(cs, "engine_prefix_hit_rate")[0] for r, cs in by_router.items()}
        p99s = {r: _mean(cs, "p99_ttft_ms")[0] for r, cs in by_router.items()}
        best_hit, best_p99 = max(hits.values()), min(p99s.values())
        for router, cs in by_router.items():
            hit, lo, hi = _mean(cs, "engine_prefix_hit_rate")
            p99, p99_lo, p99_hi = _mean(cs, "p99_ttft_ms")
            lru = _mean(cs, "pooled_lru_hit_rate")[0]
            belady = _mean(cs, "belady_hit_rate")[0]
            mark_hit = "**" if hit == best_hit else ""
            mark_p99 = "**" if p99 == best_p99 else ""
            lines.append(
                f"| {workload} | {size} | {router} | {mark_hit}{100 * hit:.1f}{mark_hit} "
                f"({100 * lo:.1f}-{100 * hi:.1f}) | {_of(hit, lru)} | "
                f"{_of(hit, belady)} | {_mean(cs, 'median_ttft_ms')[0]:.0f} | "
                f"{mark_p99}{p99:,.0f}{mark_p99} ({p99_lo:,.0f}-{p99_hi:,.0f}) | "
                f"{_mean(cs, 'request_throughput')[0]:.2f} | {len(cs)} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="8,64,1024")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--routers", default=ROUTERS)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--duration", type=float, help="engine seconds of every duration-bound workload")
    p.add_argument("--out", default="runs/table")
    p.add_argument("--jobs", type=int, default=1, help="cells run at once (one per core)")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip the ceilings (their prompt log grows with the run: agentic at "
                        "1,024 backends)")  # fmt: skip
    args = p.parse_args()
    routers = args.routers.split(",")
    for router in routers:  # an unknown name or a missing file fails before hours of runs
        name, _, config = router.partition("@")
        parse_router(name)
        if config and not Path(config).is_file():
            p.error(f"router {router!r}: no such file {config!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "cells.jsonl"
    cells = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(c["workload"], c["size"], c["router"], c["seed"]) for c in cells}
    tasks = [(workload, int(size), router, seed)
             for size in args.sizes.split(",") for workload in args.workloads.split(",")
             for seed in range(args.seeds) for router in routers
             if (workload, int(size), router, seed) not in done]  # fmt: skip
    order = {t: i for i, t in enumerate(tasks)}

    def rank(c: dict[str, Any]) -> int:  # rows in the order asked for, whatever ran first
        return order.get((c["workload"], c["size"], c["router"], c["seed"]), -1)

    with ProcessPoolExecutor(args.jobs) as pool:  # cells are independent and deterministic
        ceil = not args.no_ceilings
        started = {pool.submit(_timed_cell, *t, args.duration, ceil): t for t in tasks}
        for future in as_completed(started):
            cell, took_s = future.result()
            cells.append(cell)
            with log.open("a") as f:
                f.write(json.dumps(cell) + "\n")
            print(f"{cell['workload']:<15} {cell['size']:>5} {cell['router']:<20} seed "
                  f"{cell['seed']}: hit {100 * (cell['engine_prefix_hit_rate'] or 0):5.1f} %  "
                  f"P99 {cell['p99_ttft_ms'] or 0:9,.0f} ms  ({took_s:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            (out / "table.md").write_text(format_table(sorted(cells, key=rank)) + "\n")
    print(format_table(sorted(cells, key=rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
