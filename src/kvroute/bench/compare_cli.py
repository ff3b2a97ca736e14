"""``kvroute compare``: one workload against several routers, each on a fresh simulated fleet.

Example: ``kvroute compare --workload ranvier-stress --backends 8 --profile
codellama-13b-a100-40g --routers round_robin,kvroute,sglang --duration 120 --speedup 4``.

Router names: round_robin, least_load, power_of_two, consistent_hash, random (kvroute's
own policies), kvroute (the prefix policy), kvroute-exact (the same on the engines' KV
events: the fleet publishes them, the router runs --mode exact), kvroute:<policy> (its
parameters as kvroute:<policy>:KEY=VALUE:..., e.g. kvroute:prefix:max_holders=8),
sglang (sglang-router, cache_aware), vllm-router (cache_aware); the peers come with
``pip install '.[peers]'`` and are reported as skipped when missing.

Outputs in --out: compare.json (router -> result.json, or {"skipped"|"error": why}),
compare.txt (the table), compare_ttft_cdf.png, compare_bars.png, one folder per router
(result.json, records.jsonl, plots) and logs/ (each process's output).

Beside the engines' measured hit rate the table gives the ceiling: the hit rate an
infinite prefix cache would give over the requests that router's run sent, in the
engines' blocks (compare.json: `cache_ceiling_hit_rate`).

For kvroute routers (which say why they routed each request) the table is followed by a
decision analysis: the run cut into time windows with the share of each decision reason,
the engine-reported hit rate and the P50 TTFT per window (a growing `load` share is a
diversion spiral); per reason its hit rate, recomputed tokens and TTFT; per backend its
requests, hit rate, TTFT, requests in flight and decision mix. It is also in compare.json
(`decision_analysis`), compare.txt and <router>/decisions.png. `kvroute compare --analyze
DIR [--windows N]` prints the table and the analysis of a finished run again.

With --speedup X the engines run X times faster and the client's think times and arrival
gaps are divided by X, so the load keeps its shape; reported times are wall-clock (engine
time = X x wall).
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
from pathlib import Path
from typing import Any

from kvroute.bench.compare import CompareConfig, RouterOutcome, run_compare
from kvroute.bench.compare_report import (
    format_analyses,
    format_table,
    header_for,
    load_compare,
    write_compare,
)
from kvroute.bench.decisions import DEFAULT_WINDOWS
from kvroute.bench.report import format_failures, nothing_measured
from kvroute.bench.workloads import TRACE_FORMATS, WORKLOAD_NAMES, is_trace_replay

# config fields -> the flags that set them (CompareConfig, LoadConfig), for messages
FIELD_FLAGS = {
    "routers": "--routers",
    "num_backends": "--backends",
    "speedup": "--speedup",
    "startup_timeout_s": "--startup-timeout",
    "num_users": "--concurrency",
    "think_time_s": "--think-time",
    "rates": "--rate",
    "burstiness": "--burstiness",
    "max_concurrency": "--max-concurrency",
    "num_requests": "--num-requests",
    "duration_s": "--duration",
    "num_warmup": "--num-warmup",
    "request_timeout_s": "--timeout",
}
_CONFIG_FIELD = re.compile(r"\b(?:CompareConfig|LoadConfig)\.(\w+)")


def in_flags(message: str) -> str:
    """A config class's error message with each ``Class.field`` it names replaced by the
    flag that sets that field (``CompareConfig.num_backends`` -> ``--backends``)."""
    return _CONFIG_FIELD.sub(lambda m: FIELD_FLAGS.get(m[1], m[0]), message)


def finite(text: str) -> float:
    """A float option's value; inf and nan are refused (argparse says so, exit 2): an
    infinite duration, delay or think time never ends, and nan compares false."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def at_least_one(text: str) -> int:
    """A count option's value, >= 1 (argparse says so otherwise, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text!r}")
    return value


def parse_pair(text: str) -> tuple[float, float]:
    """``A,B`` (or ``A``) as two finite floats."""
    lo, _, hi = text.partition(",")
    return finite(lo), finite(hi or lo)


def check_trace_option(workload: str, trace: str | None) -> None:
    """ValueError when ``--trace`` is given to a workload that would not read it."""
    if trace is not None and workload not in TRACE_FORMATS:
        reads = "names its own trace" if is_trace_replay(workload) else "reads no trace"
        raise ValueError(
            f"--trace is for plain {' or '.join(TRACE_FORMATS)} (the trace file they replay);"
            f" --workload {workload} {reads}"
        )


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_fleet_and_load_options(
    p: argparse.ArgumentParser, *, out_help: str, duration_help: str
) -> None:
    """The fleet, routers, workload and load options of ``compare``, ``demo`` and
    ``simulate`` (defaults are set by each command)."""
    p.add_argument("--backends", type=int, help="simulated engines per fleet")
    p.add_argument("--profile", help="engine profile of the simulated fleet")
    p.add_argument("--routers", type=parse_list, help="comma-separated router names")
    p.add_argument("--seed", type=int, default=0, help="workload, load and engine seed")
    p.add_argument(
        "--router-config",
        metavar="FILE",
        help="a kvroute YAML (fleet, cost, policies: what `kvroute serve --config` takes, "
        "without backends) for every kvroute router: try your own settings",
    )
    p.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload parameter (repeatable)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, help="closed loop with N users")
    shape.add_argument(
        "--rate",
        type=float,
        help="open loop: R requests (sessions) per second of engine time, Poisson",
    )
    p.add_argument(
        "--max-concurrency",
        type=at_least_one,
        help="open loop: at most N requests in flight, the rest wait client-side (with "
        "--rate the default is none; gsp and prefix-repetition at their own rate: 16)",
    )
    p.add_argument("--think-time", type=parse_pair, help="closed loop think time A,B (engine s)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--duration", type=finite, help=duration_help)
    bound.add_argument("--num-requests", type=at_least_one, help="measured requests per router")
    p.add_argument("--num-warmup", type=int, help="requests left out of the metrics")
    p.add_argument("--out", help=out_help)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars or progress lines (--plan's per-fleet lines)",
    )


def add_run_options(p: argparse.ArgumentParser, *, out_help: str) -> None:
    """Options shared by ``compare`` and ``demo``: the above, plus the real fleet's."""
    add_fleet_and_load_options(
        p, out_help=out_help, duration_help="wall seconds of measured sending"
    )
    p.add_argument("--speedup", type=finite, help="engines run X times faster than real time")
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="clients send non-streaming requests (the openai SDK's default)",
    )
    p.add_argument(
        "--sim-arg", action="append", default=[], metavar="ARG", help="extra `kvroute sim` arg"
    )
    p.add_argument("--startup-timeout", type=finite, default=60.0, help="seconds per process")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="the same workload against several routers, each on a fresh simulated fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        help=f"one of: {', '.join(WORKLOAD_NAMES)} (or plain mooncake, azure); required",
    )
    p.add_argument("--trace", help="trace file for plain 'mooncake' or 'azure'")
    p.add_argument(
        "--analyze",
        metavar="DIR",
        help="run nothing: print the table and decision analysis of the comparison in DIR",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        help=f"time windows of the decision analysis with --analyze (default {DEFAULT_WINDOWS})",
    )
    add_run_options(p, out_help="output folder (default runs/compare-<time>)")
    p.set_defaults(
        func=main,
        backends=8,
        profile="codellama-13b-a100-40g",
        routers=("round_robin", "kvroute"),
        speedup=1.0,
    )
    return p


def config_from_args(args: argparse.Namespace, out: Path) -> CompareConfig:
    """The CompareConfig the options describe; ValueError for bad values."""
    overrides = dict(kv.split("=", 1) for kv in args.workload_arg if "=" in kv)
    if len(overrides) != len(args.workload_arg):
        raise ValueError("--workload-arg takes KEY=VALUE")
    check_trace_option(args.workload, getattr(args, "trace", None))
    load: dict[str, Any] = {}
    if args.concurrency is not None:
        load.update(mode="closed", num_users=args.concurrency)
    if getattr(args, "rate", None) is not None:
        # the rate asked for is offered: a workload's own cap does not hold it back
        load.update(mode="open", rates=(args.rate,), max_concurrency=args.max_concurrency)
        if args.think_time is not None:
            raise ValueError("--think-time is a closed loop's (--concurrency), not --rate's")
    elif args.max_concurrency is not None:
        if args.concurrency is not None:
            raise ValueError("--max-concurrency is an open loop's (--rate), not --concurrency's")
        load["max_concurrency"] = args.max_concurrency
    if args.think_time is not None:
        load["think_time_s"] = args.think_time
    if args.duration is not None:
        load["duration_s"] = args.duration
    if args.num_requests is not None:
        load["num_requests"] = args.num_requests
    if args.num_warmup is not None:
        load["num_warmup"] = args.num_warmup
    if getattr(args, "no_stream", False):
        load["stream"] = False
    return CompareConfig(
        workload=args.workload,
        routers=tuple(args.routers),
        num_backends=args.backends,
        profile=args.profile,
        speedup=args.speedup,
        seed=args.seed,
        workload_overrides=overrides,
        load_overrides=load,
        trace_path=getattr(args, "trace", None),
        sim_args=tuple(args.sim_arg),
        log_dir=out / "logs",
        startup_timeout_s=args.startup_timeout,
        progress=not args.quiet,
        router_config=args.router_config,
    )


def default_out(prefix: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{prefix}-{stamp}"


def run_and_report(args: argparse.Namespace, out: Path, command: str) -> int:
    """Run the comparison the options describe, print the table, write the outputs."""
    try:
        config = config_from_args(args, out)
    except ValueError as exc:
        print(f"kvroute {command}: {in_flags(str(exc))}", file=sys.stderr)
        return 2

    def notify(line: str) -> None:
        print(f"kvroute {command}: {line}", file=sys.stderr)

    try:
        outcomes = run_compare(config, notify)
    except ValueError as exc:  # a bad workload name or parameter, found before any run
        print(f"kvroute {command}: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    analysis = command == "compare"
    return report(outcomes, out, plots=not args.no_plots, analysis=analysis, command=command)


def report(
    outcomes: dict[str, RouterOutcome],
    out: Path,
    *,
    plots: bool,
    analysis: bool = False,
    command: str = "compare",
) -> int:
    """Print the table (and with ``analysis`` the decision analysis), write the outputs;
    say on stderr which routers measured no request."""
    print()
    print(format_table(outcomes, header_for(outcomes)))
    if analysis and (text := format_analyses(outcomes)):
        print(f"\n{text}")
    paths = write_compare(outcomes, out, plots=plots)
    print(f"\nwrote {out}/: " + ", ".join(str(p.relative_to(out)) for p in paths.values()))
    for name, o in outcomes.items():
        if o.bench is not None and (why := nothing_measured(o.bench)):
            print(f"kvroute {command}: {name}: {why}", file=sys.stderr)
        elif o.bench is not None and (failures := format_failures(o.bench.records)):
            print(f"\n{name}: {failures}")  # a table that says "failed" says why too
    ran = [o for o in outcomes.values() if o.skipped is None]
    ok = all(o.bench is not None and o.bench.result["completed"] > 0 for o in ran)
    return 0 if ran and ok else 1


def analyze_run(run_dir: Path, num_windows: int) -> int:
    """``--analyze DIR``: the table and the decision analysis of a written comparison."""
    try:
        if num_windows < 1:
            raise ValueError("--windows must be >= 1")
        outcomes = load_compare(run_dir)
    except (OSError, ValueError) as exc:  # no such run, or not a compare.json
        print(f"kvroute compare: {exc}", file=sys.stderr)
        return 2
    print(format_table(outcomes, header_for(outcomes)))
    text = format_analyses(outcomes, num_windows)
    print(f"\n{text}" if text else "\n(no router in this run recorded its decisions)")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.analyze:
        return analyze_run(Path(args.analyze), args.windows)
    if not args.workload:
        print("kvroute compare: --workload is required (or --analyze DIR)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out("compare")
    return run_and_report(args, out, "compare")
