"""``kvroute demo``: round-robin against kvroute on an embedded simulated fleet, no setup.

With no options: 8 simulated CodeLlama-13B engines on 40 GB A100s (little KV room, so
where a long prompt lands decides whether it is recomputed), Ranvier's "stress" request
mix from 30 closed-loop users, first behind kvroute's round-robin policy, then behind
kvroute's prefix policy, each on a fresh fleet with the same seed. The engines run
faster than real time (--speedup) so it takes about two minutes; the client's think
times are divided by the same factor, and times in the table are wall-clock.

Ends with the comparison table and the folder holding compare.json and the plots.
Same options as ``kvroute compare`` (e.g. --routers round_robin,least_load,kvroute).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvroute.bench.compare_cli import add_run_options, default_out, run_and_report

DEMO_WORKLOAD = "ranvier-stress"
DEMO_DEFAULTS: dict[str, Any] = {
    "backends": 8,
    "profile": "codellama-13b-a100-40g",
    "routers": ("round_robin", "kvroute"),
    "speedup": 4.0,
    "duration": 40.0,
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="compare round-robin and kvroute on an embedded simulated fleet (zero config)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_options(p, out_help="output folder (default runs/demo-<time>)")
    p.set_defaults(func=main, **DEMO_DEFAULTS)
    return p


def main(args: argparse.Namespace) -> int:
    args.workload = DEMO_WORKLOAD
    if args.num_requests is not None:
        args.duration = None  # a count given: it bounds the run instead of the time
    out = Path(args.out) if args.out else default_out("demo")
    return run_and_report(args, out, "demo")
