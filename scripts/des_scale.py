#!/usr/bin/env python3
"""Hit rate and P99 TTFT against fleet size, on a tiled Mooncake trace (kvroute.des.scale).

    python scripts/des_scale.py --sizes 8,16,32,64,128,256,512,1024 --out runs/scale

Defaults: the Mooncake conversation trace of ../shared/traces (first 1,000 rows, prompts
scaled by 0.1, outputs capped at 64: BENCHMARKS.md's slice) on codellama-13b-a100-40g,
8 backends per copy of the trace; routers round_robin, consistent_hash, kvroute.
Writes scale.md, scale.json and scale.png in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvroute.des.scale import format_points, plot_points, run_scale, tiled_trace
from kvroute.sim.profiles import get_profile

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--routers", default="round_robin,consistent_hash,kvroute")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--profile", default="codellama-13b-a100-40g")
    p.add_argument("--base-backends", type=int, default=8, help="backends per copy of the trace")
    p.add_argument("--workload-arg", action="append", metavar="KEY=VALUE",
                   default=["max_requests=1000", "input_scale=0.1", "output_cap=64"])  # fmt: skip
    p.add_argument(
        "--copies", type=int, help="copies of the trace whatever the size (default size / base)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/scale")
    args = p.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.workload_arg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    make = tiled_trace(args.trace, overrides, args.seed)
    sizes = [int(x) for x in args.sizes.split(",")]

    def say(point) -> None:
        f = point.figures
        hit = 100 * f["engine_prefix_hit_rate"]
        print(f"{point.num_backends:5d} {point.router:<16} hit {hit:.1f} % "
              f"P99 {f['p99_ttft_ms']:.0f} ms  {point.speed.wall_s:.1f} s wall "
              f"({point.speed.requests_per_s:.0f} req/s)", file=sys.stderr, flush=True)  # fmt: skip

    points = run_scale(
        make, get_profile(args.profile), sizes, args.routers.split(","),
        base_backends=args.base_backends, copies=args.copies, on_point=say,
    )  # fmt: skip
    table = format_points(points)
    print(table)
    (out / "scale.md").write_text(table + "\n")
    data = [{**dataclasses.asdict(p), "speed": p.speed.to_json()} for p in points]
    (out / "scale.json").write_text(
        json.dumps({"args": vars(args), "points": data}, indent=2) + "\n"
    )
    title = f"tiled Mooncake trace ({', '.join(args.workload_arg)}), {args.profile}"
    plot_points(points, out / "scale.png", title)
    print(f"wrote {out}/scale.md, scale.json, scale.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
