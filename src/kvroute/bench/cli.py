"""``kvroute bench``: offer a workload to any OpenAI-compatible endpoint and report.

Example: ``kvroute bench --target http://127.0.0.1:8000 --workload gsp --rate 4
--num-requests 200 --backend-metrics http://127.0.0.1:8001 http://127.0.0.1:8002
--out results/gsp``.

Before the load the target is asked for its /v1/models (or /health when it has no
list): a target that does not answer, a URL with a /v1 too many or a ``--model`` it does
not serve is an error naming the target (exit 2). After a run with failures, the most
common reasons are printed under the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

import aiohttp

from kvroute.bench.cli_args import check_out_dir, make_out_dir
from kvroute.bench.compare_cli import (
    at_least_one,
    check_trace_option,
    finite,
    in_flags,
    parse_pair,
)
from kvroute.bench.load import LoadConfig, default_load
from kvroute.bench.progress import rich_progress
from kvroute.bench.report import (
    format_failures,
    format_summary,
    nothing_measured,
    write_outputs,
)
from kvroute.bench.runner import (
    BenchResult,
    check_backend_metrics,
    check_target,
    check_target_url,
    run_benchmark,
)
from kvroute.bench.workloads import WORKLOAD_NAMES, Workload, is_trace_replay, make_workload

# mooncake shortcut flag -> replay parameter
_TRACE_FLAGS = {
    "speedup": "speedup",
    "max_requests": "max_requests",
    "input_scale": "input_scale",
    "output_cap": "output_cap",
}


def _rates(text: str) -> tuple[float, ...]:
    return tuple(math.inf if p.strip() == "inf" else float(p) for p in text.split(",") if p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="load generator and report against an OpenAI-compatible endpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="base URL of the router or engine")
    p.add_argument(
        "--workload",
        required=True,
        help=f"one of: {', '.join(WORKLOAD_NAMES)} (or plain mooncake, azure)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload parameter, e.g. num_groups=8 (repeatable)",
    )
    p.add_argument("--trace", help="trace file for plain 'mooncake' or 'azure'")
    p.add_argument("--speedup", type=finite, help="trace replays: divide arrival times")
    p.add_argument("--max-requests", type=int, help="trace replays: replay the first N rows")
    p.add_argument("--input-scale", type=finite, help="trace replays: scale prompt lengths")
    p.add_argument("--output-cap", type=int, help="trace replays: cap max_tokens")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop with N users")
    mode.add_argument("--rate", type=_rates, help="open loop, req/s ('inf'; '3,10,20' = ladder)")
    p.add_argument("--think-time", type=parse_pair, help="closed loop think time A,B seconds")
    p.add_argument("--burstiness", type=finite, default=1.0, help="open loop Gamma shape")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight (open loop)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--duration", type=finite, help="seconds of sending")
    bound.add_argument("--num-requests", type=at_least_one, help="measured requests")
    p.add_argument("--num-warmup", type=int, default=0, help="requests left out of the metrics")
    p.add_argument(
        "--backend-metrics",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="engine URLs whose /metrics give the true prefix-cache hit rate",
    )
    p.add_argument("--out", help="folder for result.json, records.jsonl and plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--model", help="model field (default: first of the target's /v1/models)")
    p.add_argument("--router", help="label of the router under test, stored in result.json")
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos")
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="non-streaming requests (the openai SDK's default); TTFT = whole response",
    )
    p.add_argument("--timeout", type=finite, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
    return p


def build_workload(args: argparse.Namespace) -> Workload:
    overrides = dict(kv.split("=", 1) for kv in args.workload_arg if "=" in kv)
    if len(overrides) != len(args.workload_arg):
        raise ValueError("--workload-arg takes KEY=VALUE")
    check_trace_option(args.workload, args.trace)
    for flag, param in _TRACE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            if not is_trace_replay(args.workload):
                name = flag.replace("_", "-")
                raise ValueError(f"--{name} is for trace replays (mooncake, azure) only")
            overrides[param] = str(value)
    return make_workload(args.workload, seed=args.seed, overrides=overrides, trace_path=args.trace)


def build_load(args: argparse.Namespace, workload: Workload) -> LoadConfig:
    fields: dict[str, Any] = {
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "num_warmup": args.num_warmup,
        "burstiness": args.burstiness,
        "model": args.model,
        "ignore_eos": args.ignore_eos,
        "stream": not args.no_stream,
        "request_timeout_s": args.timeout,
    }
    if args.concurrency is not None:
        fields.update(mode="closed", num_users=args.concurrency)
    elif args.rate is not None:
        fields.update(mode="open", rates=args.rate)
    if args.think_time is not None:
        fields["think_time_s"] = args.think_time
    if args.max_concurrency is not None:
        fields["max_concurrency"] = args.max_concurrency
    return default_load(workload, **fields)


async def _check(args: argparse.Namespace) -> None:
    """The target answers and serves ``--model`` (TargetError otherwise)."""
    async with aiohttp.ClientSession() as session:
        await check_target(session, args.target, args.model)
        await check_backend_metrics(session, args.backend_metrics)


async def _run(args: argparse.Namespace, workload: Workload, load: LoadConfig) -> BenchResult:
    label = f"{workload.name} -> {args.target}"
    with rich_progress(label, load.num_requests, load.duration_s, enabled=not args.quiet) as cb:
        return await run_benchmark(
            args.target,
            workload,
            load,
            args.backend_metrics,
            router=args.router,
            progress=cb,
        )


def main(args: argparse.Namespace) -> int:
    try:
        check_target_url(args.target)
        if args.out is not None:
            check_out_dir(args.out)
        workload = build_workload(args)
        load = build_load(args, workload)
        asyncio.run(_check(args))
        if args.out is not None:
            make_out_dir(args.out)
    except (ValueError, OSError) as exc:
        print(f"kvroute bench: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    bench = asyncio.run(_run(args, workload, load))
    print(format_summary(bench.result))
    if failures := format_failures(bench.records):
        print(failures)
    if args.out:
        paths = write_outputs(bench, args.out, plots=not args.no_plots)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    if why := nothing_measured(bench):
        print(f"kvroute bench: {why}", file=sys.stderr)
    if stopped := bench.result.get("stopped_early"):
        print(f"kvroute bench: {stopped}", file=sys.stderr)
    return 0 if bench.result["completed"] > 0 else 1
