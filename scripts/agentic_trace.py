#!/usr/bin/env python3
"""Write the ``agentic`` workload as a Mooncake-format trace (bench/workloads/agentic_trace.py).

    python scripts/agentic_trace.py --users 54 --duration 600 --out runs/agentic-trace.jsonl
    kvroute simulate --workload mooncake --trace runs/agentic-trace.jsonl --backends 4 \\
      --profile llama-3.1-8b-a100 --routers round_robin,kvroute,sglang-cache-aware
    kvroute compare --workload mooncake --trace runs/agentic-trace.jsonl --backends 4 \\
      --profile llama-3.1-8b-a100 --routers kvroute,sglang,vllm-router --speedup 4

The defaults give about 2,100 requests in 10 minutes on 3 harness prompts, contexts
growing to 30k tokens, an infinite-cache ceiling of about 92 %: agent coding sessions
replayed open loop, without session headers. ``--workload-arg`` sets the workload's
parameters (``AgenticParams``), as in ``kvroute compare``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.agentic import Agentic
from kvroute.bench.workloads.agentic_trace import agentic_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--users", type=int, default=54, help="sessions running at once")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-s", type=float, default=0.5, help="nominal time to first token")
    ap.add_argument("--itl-s", type=float, default=0.03, help="nominal seconds per output token")
    ap.add_argument("--start-spread-s", type=float, default=30.0,
                    help="users start uniformly over this many seconds")  # fmt: skip
    ap.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    overrides = dict(kv.split("=", 1) for kv in args.workload_arg if "=" in kv)
    if len(overrides) != len(args.workload_arg):
        ap.error("--workload-arg takes KEY=VALUE")
    try:
        workload = make_workload("agentic", seed=args.seed, overrides=overrides)
        if not isinstance(workload, Agentic):
            raise ValueError("tile is not a parameter of this trace: write one and tile its replay")
        rows = agentic_trace(
            workload,
            users=args.users,
            duration_s=args.duration,
            ttft_s=args.ttft_s,
            itl_s=args.itl_s,
            start_spread_s=args.start_spread_s,
        )
    except ValueError as exc:
        ap.error(str(exc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row.to_json_obj()) + "\n" for row in rows)
    mean = sum(r.input_length for r in rows) / max(1, len(rows))
    sessions = len({r.session for r in rows})
    print(f"wrote {args.out}: {len(rows):,} requests of {sessions} sessions over "
          f"{args.duration:.0f} s, {mean:,.0f} prompt tokens on average")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
