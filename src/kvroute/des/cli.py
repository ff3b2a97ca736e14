"""``kvroute simulate``: ``kvroute compare`` in virtual time, on fleets of any size.

Example: ``kvroute simulate --workload gsp --backends 8 --profile codellama-13b-a100-40g
--routers round_robin,consistent_hash,kvroute,kvroute-exact --num-requests 3000``.

The same engines (engine/), the same Fleet, policies and cost model (core/), the same
workloads and load shapes (bench/) as ``kvroute compare``, driven by an event heap
instead of sockets and a clock (kvroute.des): minutes of engine time take seconds, every
run is repeatable to the byte, and fleets of a thousand engines fit on a laptop. The
router learns what the live router learns, when it would (des/router.py); in exact mode
the engines' KV events reach it ``--kv-event-delay-ms`` after the step that made them.

Outputs are ``kvroute compare``'s (the table, compare.json, compare.txt, plots, one
folder per router), with times in engine seconds, plus three ceilings per run: an
infinite prefix cache; one LRU cache as big as the whole fleet's KV memory; and Belady's
optimal replacement on that pooled cache, which no router can beat (des/ceilings.py).
How fast the simulator ran goes to speed.json (wall-clock: the only file that differs
between two runs with the same seed).

Router names as in ``kvroute compare`` for kvroute's own policies (round_robin,
least_load, power_of_two, consistent_hash, random, kvroute, kvroute-exact,
kvroute:<policy>[:KEY=VALUE...]). The real peers (sglang, vllm-router) run only in
``kvroute compare``.

``--plan`` turns it into a capacity planner: for each router, the smallest fleet whose
P99 TTFT meets ``--slo-ttft-p99`` (doubling, then bisecting the fleet size), its GPUs and
monthly cost at ``--gpu-cost-per-hour``, and the saving against round-robin
(plan.txt, plan.json, plan.png in ``--out``; des/plan.py). Example: ``kvroute simulate
--plan --workload ranvier-stress --concurrency 30 --duration 600 --slo-ttft-p99 1
--gpu-cost-per-hour 1.25``.

Trace workloads take ``--workload-arg tile=N``: N independent copies of the trace
(disjoint prompts, interleaved by arrival) for fleets larger than the trace's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvroute.bench.compare import (
    CompareConfig,
    RouterOutcome,
    build_load,
    build_workload,
    spread_note,
)
from kvroute.bench.compare_cli import (
    add_fleet_and_load_options,
    config_from_args,
    default_out,
    finite,
    in_flags,
    parse_list,
    report,
)
from kvroute.bench.load import LoadConfig
from kvroute.bench.procs import RouterSpec, parse_router
from kvroute.bench.progress import rich_progress
from kvroute.bench.workloads import WORKLOAD_NAMES
from kvroute.des.plan import (
    HOURS_PER_MONTH,
    Pricing,
    Probe,
    format_plan,
    plan_json,
    plan_rows,
    plot_plan,
    refused,
    smallest_fleet,
)
from kvroute.des.report import format_ceilings, format_reuse_regime, format_speed
from kvroute.des.router import router_config
from kvroute.des.simulation import (
    DEFAULT_KV_EVENT_DELAY_S,
    DEFAULT_REQUEST_OVERHEAD_S,
    Speed,
    Timing,
    simulate_router,
)
from kvroute.engine.profiles import EngineProfile
from kvroute.router.config_sections import normalize_url
from kvroute.sim.profiles import get_profile

BASELINE = "round_robin"  # --plan's savings are against it


# the fleet sizes --plan searches by default
PLAN_MIN_BACKENDS, PLAN_MAX_BACKENDS = 1, 1024


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="kvroute compare in virtual time: the discrete-event fleet simulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        required=True,
        help=f"one of: {', '.join(WORKLOAD_NAMES)} (or plain mooncake, azure)",
    )
    p.add_argument("--trace", help="trace file for plain 'mooncake' or 'azure'")
    add_fleet_and_load_options(
        p,
        out_help="output folder (default runs/simulate-<time>)",
        duration_help="engine seconds of measured sending",
    )
    p.add_argument(
        "--kv-event-delay-ms",
        type=finite,
        default=DEFAULT_KV_EVENT_DELAY_S * 1000.0,
        help="exact mode: a step's KV events reach the router this long after it ends "
        f"(default {DEFAULT_KV_EVENT_DELAY_S * 1000.0:g})",
    )
    p.add_argument(
        "--request-overhead-ms",
        type=finite,
        default=DEFAULT_REQUEST_OVERHEAD_S * 1000.0,
        help="the proxy's added latency per request "
        f"(default {DEFAULT_REQUEST_OVERHEAD_S * 1000.0:g})",
    )
    p.add_argument(
        "--backend-urls",
        type=parse_list,
        help="names of the simulated backends, comma-separated (default http://sim-0, ...): "
        "a consistent-hash ring is built on them, so a real run's URLs replay its ring",
    )
    p.add_argument(
        "--no-ceilings",
        action="store_true",
        help="skip the hit-rate ceilings: their log of every prompt block sent (8 bytes "
        "each) grows with the run: much of a long-context run's memory",
    )
    p.add_argument(
        "--no-fast-forward",
        action="store_true",
        help="step every engine step by step (same results, slower; for checking)",
    )
    plan = p.add_argument_group("capacity planning (--plan)")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="find each router's smallest fleet meeting --slo-ttft-p99 (--backends ignored)",
    )
    plan.add_argument("--slo-ttft-p99", type=finite, metavar="SECONDS", help="P99 TTFT objective")
    plan.add_argument(
        "--gpu-cost-per-hour", type=finite, metavar="DOLLARS", help="price of one GPU-hour"
    )
    plan.add_argument(
        "--min-backends", type=int, help=f"smallest fleet tried (default {PLAN_MIN_BACKENDS})"
    )
    plan.add_argument(
        "--max-backends", type=int, help=f"largest fleet tried (default {PLAN_MAX_BACKENDS})"
    )
    p.set_defaults(
        func=main,
        backends=8,
        profile="codellama-13b-a100-40g",
        routers=("round_robin", "kvroute"),
        # compare's options the simulator does not take, as config_from_args reads them
        speedup=1.0,
        sim_arg=[],
        startup_timeout=60.0,
    )
    return p


def main(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_out("simulate")
    try:
        config = config_from_args(args, out)
        profile = get_profile(config.profile)
        timing = Timing(args.request_overhead_ms / 1000.0, args.kv_event_delay_ms / 1000.0)
        workload = build_workload(config)
        load = build_load(config, workload, profile.name)
        if note := spread_note(workload):
            print(f"kvroute simulate: note: {note}", file=sys.stderr)
        if args.backend_urls is not None and len(args.backend_urls) != config.num_backends:
            raise ValueError(f"--backend-urls names {len(args.backend_urls)}, --backends is "
                             f"{config.num_backends}")  # fmt: skip
        if args.backend_urls is not None:  # as the router takes them: checked before a run
            urls = [normalize_url(u) for u in args.backend_urls]
            if len(set(urls)) != len(urls):
                raise ValueError("--backend-urls names one backend twice")
        if args.plan:
            pricing = _plan_pricing(args, profile.gpus)
            unused = (
                ("--backend-urls", args.backend_urls),
                ("--no-ceilings", args.no_ceilings),
                ("--no-fast-forward", args.no_fast_forward),
            )
            ignored = [flag for flag, value in unused if value]
            if ignored:
                raise ValueError(f"{', '.join(ignored)}: not used by --plan")
        else:
            planning = [f for f, v in (("--slo-ttft-p99", args.slo_ttft_p99),
                                       ("--gpu-cost-per-hour", args.gpu_cost_per_hour),
                                       ("--min-backends", args.min_backends),
                                       ("--max-backends", args.max_backends))
                        if v is not None]  # fmt: skip
            if planning:
                raise ValueError(f"{', '.join(planning)}: only with --plan")
        if config.router_config is not None:  # its errors before any run, not in one
            urls = [f"http://sim-{i}" for i in range(config.num_backends)]
            for name in config.routers:
                if (spec := parse_router(name)).kind == "kvroute":
                    router_config(spec, urls, config.router_config)
    except ValueError as exc:
        print(f"kvroute simulate: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    if args.plan:
        return _run_plan(args, config, profile, load, timing, pricing, out)
    outcomes: dict[str, RouterOutcome] = {}
    speeds: dict[str, Speed] = {}
    for name in config.routers:
        spec = parse_router(name)
        outcome = outcomes[name] = RouterOutcome(name)
        if spec.kind != "kvroute":
            outcome.skipped = f"the real {spec.kind} runs only in `kvroute compare`"
            print(f"kvroute simulate: {name}: skipped ({outcome.skipped})", file=sys.stderr)
            continue
        workload = build_workload(config)
        with rich_progress(
            f"{name:<16}", load.num_requests, load.duration_s, enabled=not args.quiet
        ) as progress:
            bench, speed = simulate_router(
                spec,
                profile,
                config.num_backends,
                workload,
                load,
                timing=timing,
                fast_forward=not args.no_fast_forward,
                progress=progress,
                urls=args.backend_urls,
                compute_ceilings=not args.no_ceilings,
                router_config=config.router_config,
                extra_config={"seed": config.seed, "router_config": config.router_config},
            )
        outcome.bench, speeds[name] = bench, speed
    code = report(outcomes, out, plots=not args.no_plots, analysis=True, command="simulate")
    if not args.no_ceilings and (text := format_ceilings(outcomes)):
        print(f"\n{text}")
        with (out / "compare.txt").open("a") as f:
            f.write(f"\n{text}\n")
    if text := format_reuse_regime(outcomes):
        print(f"\n{text}")
        with (out / "compare.txt").open("a") as f:
            f.write(f"\n{text}\n")
    if speeds:
        print(f"\n{format_speed(speeds)}")
        data = {name: s.to_json() for name, s in speeds.items()}
        (out / "speed.json").write_text(json.dumps(data, indent=2) + "\n")
    return code


def _plan_pricing(args: argparse.Namespace, gpus_per_replica: int) -> Pricing:
    if args.slo_ttft_p99 is None or args.gpu_cost_per_hour is None:
        raise ValueError("--plan needs --slo-ttft-p99 SECONDS and --gpu-cost-per-hour DOLLARS")
    if args.slo_ttft_p99 <= 0 or args.gpu_cost_per_hour < 0:
        raise ValueError("--slo-ttft-p99 must be > 0 and --gpu-cost-per-hour >= 0")
    if args.min_backends is None:
        args.min_backends = PLAN_MIN_BACKENDS
    if args.max_backends is None:
        args.max_backends = PLAN_MAX_BACKENDS
    if not 1 <= args.min_backends <= args.max_backends:
        raise ValueError("need 1 <= --min-backends <= --max-backends")
    return Pricing(args.gpu_cost_per_hour, gpus_per_replica)


def _run_plan(
    args: argparse.Namespace,
    config: CompareConfig,
    profile: EngineProfile,
    load: LoadConfig,
    timing: Timing,
    pricing: Pricing,
    out: Path,
) -> int:
    """``--plan``: the smallest fleet per router (des/plan.py), against round-robin."""
    routers = list(dict.fromkeys([BASELINE, *config.routers]))
    plans = []
    for name in routers:
        spec = parse_router(name)
        if spec.kind != "kvroute":
            print(f"kvroute simulate: {name}: skipped (the real {spec.kind} runs only in "
                  "`kvroute compare`)", file=sys.stderr)  # fmt: skip
            continue

        def probe(n: int, spec: RouterSpec = spec, name: str = name) -> Probe:
            bench, _ = simulate_router(
                spec, profile, n, build_workload(config), load, timing=timing, keep_itl=False,
                router_config=config.router_config,
            )  # fmt: skip
            p = Probe.from_result(n, bench.result, refused(bench.records))
            if not args.quiet:
                p99 = "none" if p.p99_ttft_s is None else f"{p.p99_ttft_s:.2f} s"
                verdict = "meets" if p.meets(args.slo_ttft_p99) else "misses"
                print(f"  {name:<20} {n:>5} replicas: P99 TTFT {p99}, {p.num_failed} failed, "
                      f"{p.num_refused} refused as too long -> {verdict}", flush=True)  # fmt: skip
            return p

        plans.append(
            smallest_fleet(
                name,
                probe,
                args.slo_ttft_p99,
                min_replicas=args.min_backends,
                max_replicas=args.max_backends,
            )
        )
    rows = plan_rows(plans, pricing, BASELINE)
    text = format_plan(rows, args.slo_ttft_p99, pricing, args.max_backends)
    print(f"\n{text}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.txt").write_text(text + "\n")
    settings = {
        "workload": config.workload,
        "profile": profile.name,
        "seed": config.seed,
        "load": load.to_json(),
        "slo_ttft_p99_s": args.slo_ttft_p99,
        "gpu_cost_per_hour": pricing.gpu_cost_per_hour,
        "gpus_per_replica": pricing.gpus_per_replica,
        "hours_per_month": HOURS_PER_MONTH,
        "baseline": BASELINE,
        "min_replicas": args.min_backends,
        "max_replicas": args.max_backends,
    }
    data = plan_json(plans, rows, settings)
    (out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    written = ["plan.txt", "plan.json"]
    if not args.no_plots:
        title = f"{config.workload} on {profile.name}: P99 TTFT against fleet size"
        plot_plan(plans, args.slo_ttft_p99, out / "plan.png", title)
        written.append("plan.png")
    print(f"\nwrote {out}/: " + ", ".join(written))
    return 0
