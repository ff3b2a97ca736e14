"""``kvroute chaos``: a seeded fault schedule on a simulated fleet behind kvroute (exact mode).

Example: ``kvroute chaos --seed 7 --duration 60``; same seed, same schedule. Prints each
fault as it is applied, the requests by outcome, the failures per fault kind and the
invariants (bench/chaos.py); writes chaos.json. Exit code 0 when every invariant holds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvroute.bench.chaos import ChaosConfig, ChaosResult, run_chaos, write_report
from kvroute.bench.chaos_faults import FAULT_KINDS
from kvroute.bench.cli_args import int_at_least, make_out_dir, positive_float
from kvroute.bench.procs import error_line, exit_on_sigterm


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kinds {bad}; known: {FAULT_KINDS}")
    return kinds


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chaos",
        help="run a seeded fault schedule on a simulated fleet behind kvroute; check invariants",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = ChaosConfig()
    p.add_argument("--seed", type=int, default=d.seed, help="schedule and load seed (0)")
    p.add_argument("--duration", type=positive_float, default=d.duration_s,
                   help="seconds of faults (60)")  # fmt: skip
    p.add_argument("--backends", type=int_at_least(2), default=d.backends,
                   help="simulators, >= 2: one is fault-free at any time (3)")  # fmt: skip
    p.add_argument("--users", type=int_at_least(1), default=d.users,
                   help="closed-loop clients (6)")  # fmt: skip
    every = ",".join(FAULT_KINDS)
    p.add_argument("--kinds", type=_kinds, default=d.kinds,
                   help=f"comma-separated fault kinds (default all: {every})")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a temp dir)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    try:
        out = None if args.out is None else make_out_dir(args.out)
        config = ChaosConfig(duration_s=args.duration, seed=args.seed, backends=args.backends,
                             users=args.users, kinds=args.kinds, out=out)  # fmt: skip
    except ValueError as exc:
        print(f"kvroute chaos: {exc}", file=sys.stderr)
        return 2
    console = Console()
    exit_on_sigterm()
    try:
        result = asyncio.run(run_chaos(config, notify=console.print))
    except (RuntimeError, TimeoutError, OSError) as exc:  # a process did not start
        print(f"kvroute chaos: {error_line(exc)}", file=sys.stderr)
        return 1
    path = write_report(result)
    for table in report_tables(result):
        console.print(table)
    console.print(f"report: {path}")
    return 0 if result.passed else 1


def report_tables(result: ChaosResult) -> list[Table]:
    outcomes = Table(title=f"seed {result.config.seed}: requests by outcome")
    outcomes.add_column("outcome")
    outcomes.add_column("requests", justify="right")
    for name, n in result.outcomes.items():
        outcomes.add_row(name, str(n))
    faults = Table(title="failures by overlapping fault")
    faults.add_column("fault")
    faults.add_column("failures", justify="right")
    for name, n in result.failures_by_fault.items():
        faults.add_row(name, str(n))
    faults.add_row("(no fault active)", str(result.failures_outside_faults))
    inv = Table(title=f"invariants: {'PASS' if result.passed else 'FAIL'}")
    inv.add_column("invariant")
    inv.add_column("ok")
    inv.add_column("figures")
    for name, v in result.invariants.items():
        figures = ", ".join(f"{k}={v[k]}" for k in v if k != "ok")
        inv.add_row(name, "[green]yes[/]" if v["ok"] else "[red]NO[/]", figures)
    return [outcomes, faults, inv]
