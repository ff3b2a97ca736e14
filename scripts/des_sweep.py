#!/usr/bin/env python3
"""kvroute's gain over round-robin by model size and shared-prefix length (kvroute.des.sweep).

    python scripts/des_sweep.py --out runs/sweep

Defaults: profiles llama-3.1-8b, codellama-13b and llama-3.1-70b TP-4 on A100 and H100;
gsp system prompts of 256, 1,024, 4,096 and 15,872 tokens (the longest that fits the
13B's 16k context with gsp's question and output); 8 backends, 4 users per backend,
closed loop, 512 requests of warm-up (every group once on every backend under
round-robin), then 240 engine seconds. Writes sweep.md, sweep.json and sweep.png in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvroute.des.sweep import format_cells, plot_gains, run_sweep
from kvroute.sim.profiles import get_profile

PROFILES = (
    "llama-3.1-8b-a100,codellama-13b-a100,llama-3.1-70b-a100-tp4,"
    "llama-3.1-8b-h100,codellama-13b-h100,llama-3.1-70b-h100-tp4"
)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profiles", default=PROFILES)
    p.add_argument("--prefix-tokens", default="256,1024,4096,15872")
    p.add_argument("--routers", default="round_robin,kvroute")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--users-per-backend", type=int, default=4)
    p.add_argument("--duration", type=float, default=240.0, help="engine seconds per run")
    p.add_argument("--num-warmup", type=int, default=512, help="requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/sweep")
    args = p.parse_args()
    routers = args.routers.split(",")
    router, baseline = routers[-1], routers[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def say(cell) -> None:
        f = cell.figures
        print(f"{cell.profile:<24} {cell.prefix_tokens:>6} {cell.router:<16} "
              f"hit {100 * (f['engine_prefix_hit_rate'] or 0):5.1f} %  "
              f"P99 TTFT {f['p99_ttft_ms']:8.0f} ms  {f['request_throughput']:6.2f} req/s",
              file=sys.stderr, flush=True)  # fmt: skip

    cells = run_sweep(
        [get_profile(name) for name in args.profiles.split(",")],
        [int(x) for x in args.prefix_tokens.split(",")],
        routers,
        num_backends=args.backends,
        users_per_backend=args.users_per_backend,
        duration_s=args.duration,
        num_warmup=args.num_warmup,
        seed=args.seed,
        on_cell=say,
    )
    table = format_cells(cells, router, baseline)
    print(table)
    (out / "sweep.md").write_text(table + "\n")
    data = {"settings": vars(args), "cells": [dataclasses.asdict(c) for c in cells]}
    (out / "sweep.json").write_text(json.dumps(data, indent=2) + "\n")
    title = (
        f"gsp (64 groups), {args.backends} backends, {args.users_per_backend} users per "
        f"backend, closed loop, {args.duration:g} engine s: {router} against {baseline}"
    )
    plot_gains(cells, router, baseline, out / "sweep.png", title)
    print(f"wrote {out}/: sweep.md, sweep.json, sweep.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
