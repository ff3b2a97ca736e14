"""``kvroute soak``: the router under a mixed load with backend restarts, sampled and judged.

Example (the 30-minute run): ``kvroute soak --out soak-30m``; a quick look:
``kvroute soak --duration 60 --sample-s 2 --restart-every-s 20``. Prints one line per
sample and the verdict; writes soak.json (samples, outcomes, verdict) and soak.png.
Exit code 0 when the verdict passes (bench/soak.py defines it), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvroute.bench.cli_args import (
    engine_profile,
    int_at_least,
    make_out_dir,
    non_negative_float,
    positive_float,
)
from kvroute.bench.procs import error_line, exit_on_sigterm
from kvroute.bench.soak import Sample, SoakConfig, SoakResult, run_soak, write_outputs


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "soak",
        help="run the router under a mixed load with backend restarts; check nothing grows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = SoakConfig()
    p.add_argument("--duration", type=positive_float, default=d.duration_s,
                   help="load seconds (1800)")  # fmt: skip
    p.add_argument("--sample-s", type=positive_float, default=d.sample_s,
                   help="sampling period (10)")  # fmt: skip
    p.add_argument("--restart-every-s", type=non_negative_float, default=d.restart_every_s,
                   help="kill and restart one backend this often, 0: never (180)")  # fmt: skip
    p.add_argument("--restart-down-s", type=non_negative_float, default=d.restart_down_s,
                   help="seconds a killed backend stays down (2)")  # fmt: skip
    p.add_argument("--warmup-s", type=non_negative_float, default=None,
                   help="seconds before the flat check starts (max(2 samples, 10 %%))")  # fmt: skip
    p.add_argument("--backends", type=int_at_least(2), default=d.backends,
                   help="simulators, >= 2: one restarts while others serve (3)")  # fmt: skip
    p.add_argument("--users", type=int_at_least(1), default=d.users,
                   help="closed-loop clients (8)")  # fmt: skip
    p.add_argument("--mode", default=d.mode, choices=("exact", "approximate", "auto"))
    p.add_argument("--profile", type=engine_profile, default=d.profile,
                   help="simulator profile (tiny)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a temp dir)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    try:
        config = SoakConfig(
            duration_s=args.duration, sample_s=args.sample_s,
            restart_every_s=args.restart_every_s, restart_down_s=args.restart_down_s,
            warmup_s=args.warmup_s, backends=args.backends, users=args.users, mode=args.mode,
            profile=args.profile, seed=args.seed,
            out=None if args.out is None else make_out_dir(args.out),
        )  # fmt: skip
    except ValueError as exc:
        print(f"kvroute soak: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(
        f"[bold]kvroute soak[/]: {config.duration_s:g} s, sample every {config.sample_s:g} s, "
        f"a backend restarted every {config.restart_every_s:g} s, {config.backends} backends, "
        f"{config.users} users, mode {config.mode}"
    )
    console.print(f"{'t s':>7} {'RSS MiB':>8} {'fds':>5} {'index':>7} {'tasks':>6} "
                  f"{'in flight':>9} {'tokens':>8} {'done':>7} {'failed':>6}")  # fmt: skip

    def notify(s: Sample, _: SoakResult) -> None:
        console.print(
            f"{s.t_s:7.0f} {s.rss_mib:8.1f} {s.fds:5d} {_n(s.index_blocks):>7} "
            f"{_n(s.tasks):>6} {s.in_flight_requests:9.0f} {s.in_flight_tokens:8.0f} "
            f"{s.num_done:7d} {s.num_failed:6d}"
        )

    exit_on_sigterm()
    try:
        result = asyncio.run(run_soak(config, notify))
    except (RuntimeError, TimeoutError, OSError) as exc:  # a process did not start
        print(f"kvroute soak: {error_line(exc)}", file=sys.stderr)
        return 1
    paths = write_outputs(result)
    console.print(verdict_table(result))
    console.print(f"samples and verdict: {paths['json']}\nplot: {paths['plot']}")
    return 0 if result.passed else 1


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def verdict_table(result: SoakResult) -> Table:
    table = Table(title=f"soak verdict: {'PASS' if result.passed else 'FAIL'}")
    table.add_column("check")
    table.add_column("figures")
    table.add_column("ok")
    for name, v in result.flat.items():
        if "level" in v:
            change = "" if v["change"] is None else f" ({100 * v['change']:+.1f} %)"
            figures = (
                f"level {v['level']:.1f} -> end {v['end']:.1f}{change}, limit {v['limit']:.1f}"
            )
        else:
            figures = v.get("why", "")
        table.add_row(f"flat: {name}", figures, _mark(v["flat"]))
    leaked = ", ".join(f"{k} {v:g}" for k, v in result.leaked.items())
    table.add_row("no leaked tickets", leaked, _mark(not any(result.leaked.values())))
    outcomes = ", ".join(f"{k} {v}" for k, v in result.outcomes.items())
    table.add_row("nothing lost", outcomes, _mark(result.outcomes.get("failed", 0) == 0))
    for what, n in result.failures.items():
        table.add_row("", f"failed: {what} x{n}", "")
    restarts = sum(1 for r in result.restarts if r.ready_s is not None)
    table.add_row("router alive", f"{restarts} backend restarts", _mark(result.router_alive))
    return table


def _mark(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[red]NO[/]"
