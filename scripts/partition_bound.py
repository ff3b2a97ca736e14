#!/usr/bin/env python3
"""How far can placement alone lift the hit rate? Frequency partitions in the simulator.

    python scripts/partition_bound.py --workload zipf-hot --seeds 3
    python scripts/partition_bound.py --workload gsp --seeds 3 --grid 8:64,7:28

Each engine's prefix cache is LRU; a router decides only which cache a request fills.
The strongest placement a router can hold for good, short of knowing the future, is a
frequency partition: the K most requested prefixes (counted online by their first
block) pinned to H "hot" backends, balanced by their request counts, and every other
prefix sent to the remaining backends, so one-off prompts never evict a hot prefix
(a cross-backend segmented LRU). This script runs that oracle-like partition for each
H:K of ``--grid`` beside kvroute and the model of SGLang's router, mean of ``--seeds``
seeds, with the pooled-LRU and Belady ceilings. It is an analysis tool (issue 11's
bar), not a policy: it ignores load except among the cold backends.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.core.policy import POLICIES
from kvroute.core.policy.base import Decision, FleetView, Policy, Reason, RouteRequest
from kvroute.des.simulation import simulate_router
from kvroute.sim.profiles import get_profile


class FrequencyPartition(Policy):
    """The K most requested prefixes on H backends (sticky, balanced by count); the rest
    on the other backends, least loaded first."""

    name = "frequency-partition"
    hot_backends = 6
    hot_prefixes = 48

    def __init__(self, params: object = None) -> None:
        self._count: Counter[int] = Counter()
        self._home: dict[int, str] = {}
        self._mass: Counter[str] = Counter()

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = sorted(view.candidates())
        if not urls:
            return None
        root = int(request.block_hashes[0]) if request.block_hashes else 0
        self._count[root] += 1
        hot, cold = urls[: self.hot_backends], urls[self.hot_backends :] or urls
        if root in {r for r, _ in self._count.most_common(self.hot_prefixes)}:
            url = self._home.get(root) or min(hot, key=lambda u: (self._mass[u], u))
            self._home[root] = url
            self._mass[url] += 1
        else:
            url = min(cold, key=lambda u: (view.load(u).in_flight_tokens, u))
        return Decision(url, Reason.HASH, 0, (url,), None)


def run(router: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    overrides = dict(kv.split("=", 1) for kv in args.workload_arg)
    workload = make_workload(args.workload, seed=seed, overrides=overrides, trace_path=args.trace)
    load = default_load(workload, seed=seed, duration_s=args.duration)
    profile = get_profile(args.profile)
    bench, _ = simulate_router(parse_router(router), profile, args.backends, workload, load)
    return bench.result


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="zipf-hot")
    p.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--trace", help="trace file of a trace workload (mooncake)")
    p.add_argument("--profile", default="codellama-13b-a100-40g")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--duration", type=float, default=360.0, help="engine seconds per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--grid", default="8:64,7:56,7:48,6:48", help="H:K: hot backends:prefixes")
    args = p.parse_args()
    POLICIES[FrequencyPartition.name] = FrequencyPartition
    rows = [("kvroute", "kvroute"), ("sglang-cache-aware", "sglang-cache-aware")]
    for pair in args.grid.split(","):
        h, k = pair.split(":")
        rows.append((f"partition H={h} K={k}", f"kvroute:frequency-partition@{h}:{k}"))
    print(f"{args.workload}, {args.backends} x {args.profile}, {args.seeds} seeds, engine time")
    print("| placement | engine hit % (range) | P99 TTFT ms | pooled LRU / Belady % |")
    print("|---|---|---|---|")
    for label, router in rows:
        figures = []
        for seed in range(args.seeds):
            name, _, hk = router.partition("@")
            if hk:
                h, k = hk.split(":")
                FrequencyPartition.hot_backends, FrequencyPartition.hot_prefixes = int(h), int(k)
            r = run(name, args, seed)
            hit_pct = 100 * r["engine_prefix_hit_rate"]
            lru, belady = 100 * r["pooled_lru_hit_rate"], 100 * r["belady_hit_rate"]
            figures.append((hit_pct, r["p99_ttft_ms"], lru, belady))
        hit = [f[0] for f in figures]
        mean = [statistics.mean(c) for c in zip(*figures, strict=True)]
        print(f"| {label} | {mean[0]:.1f} ({min(hit):.1f}-{max(hit):.1f}) | {mean[1]:.0f} "
              f"| {mean[2]:.1f} / {mean[3]:.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
