"""``kvroute sim``: N simulated vLLM-compatible engines in one process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from kvroute.sim.faults import FAULT_HELP, Faults, parse_fault_spec

EPILOG = """\
Each backend serves vLLM's HTTP surface (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /tokenize) on port PORT_BASE+i, and with --kv-events
publishes KV-cache events (ZMQ PUB, topic "kv-events", frames [topic, seq, msgpack])
on port KV_PORT_BASE+i. Engine time runs --speedup times faster than wall time; the
latencies in /metrics are wall seconds. Differences from vLLM: one prompt per request
(a batch of more is a 400), n=1, sampling parameters ignored, output always ends by
length (default max_tokens 16, also for chat). Faults at run time:
  curl -X POST localhost:8001/sim/faults -d '{"error": 503}'      # or hang, slow, drop,
  curl -X POST localhost:8001/sim/faults -d '{"drop": 3}'         #    unhealthy, flap,
  curl -X POST localhost:8001/sim/faults -d '{"kv_gap": 5}'       #    kv_gap, kv_garbage
  curl localhost:8001/sim/faults;  curl -X DELETE localhost:8001/sim/faults
"""
PORTS_HINT = (
    "--host, --port-base, --kv-port-base and --kv-replay-port-base choose the addresses "
    "(a base of 0: free ports)"
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="run N simulated vLLM-compatible engines",
        description="Run N simulated vLLM engines (prefix caching, continuous batching) "
        "in real time, each on its own port.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backends", type=int, default=1, help="number of engines (default 1)")
    p.add_argument("--port-base", type=int, default=8001, help="first HTTP port (default 8001)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--profile",
        default="llama-3.1-8b-a100",
        help="engine profile name or YAML file (default llama-3.1-8b-a100)",
    )
    p.add_argument("--model", default=None, help="served model name (default: the profile name)")
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="divide every modelled duration by X (default 1: real time)",
    )
    p.add_argument("--kv-events", action="store_true", help="publish KV events over ZMQ")
    p.add_argument(
        "--kv-port-base", type=int, default=5557, help="first KV-event port (default 5557)"
    )
    p.add_argument("--kv-replay", action="store_true", help="also serve replays on a ROUTER socket")
    p.add_argument(
        "--kv-replay-port-base",
        type=int,
        default=0,
        help="first replay port (default 0: free ports; fixed ports survive a restart)",
    )
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help=FAULT_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed of the step-time jitter")
    p.add_argument(
        "--jitter", type=float, default=0.0, help="+- fraction of step-time jitter (default 0)"
    )
    p.set_defaults(func=run)


def faults_by_backend(specs: list[str], n: int) -> dict[int, Faults]:
    """``--fault`` specs -> the Faults of each backend index; ValueError if out of range."""
    faults = {i: Faults() for i in range(n)}
    for spec in specs:
        index, change = parse_fault_spec(spec)
        if index is not None and index >= n:
            raise ValueError(f"fault {spec!r}: no backend {index} (there are {n})")
        for i in [index] if index is not None else range(n):
            faults[i].update(change)
    return faults


def run(args: argparse.Namespace) -> int:
    try:
        faults = faults_by_backend(args.fault, args.backends)
        if args.backends < 1:
            raise ValueError("--backends must be >= 1")
        for flag, base in (
            ("--port-base", args.port_base),
            ("--kv-port-base", args.kv_port_base if args.kv_events else 0),
            ("--kv-replay-port-base", args.kv_replay_port_base if args.kv_replay else 0),
        ):
            last = base + args.backends - 1
            if base and not 0 < base <= last <= 65535:  # 0: free ports
                raise ValueError(
                    f"{flag} {base} with {args.backends} backends needs ports {base}-{last}: "
                    "choose a base from 1 to " + str(65536 - args.backends)
                )
    except ValueError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    return int(runner(_serve(args, faults)))


async def _serve(args: argparse.Namespace, faults: dict[int, Faults]) -> int:
    from kvroute.sim.server import start_fleet

    try:
        fleet = await start_fleet(
            args.backends,
            args.port_base,
            args.profile,
            args.speedup,
            args.kv_events,
            host=args.host,
            kv_port_base=args.kv_port_base,
            kv_replay=args.kv_replay,
            kv_replay_port_base=args.kv_replay_port_base,
            model_name=args.model,
            faults=faults,
            seed=args.seed,
            jitter=args.jitter,
        )
    except ValueError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port in use, an address not of this machine
        print(f"kvroute sim: {exc}; {PORTS_HINT}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    b0 = fleet.backends[0]
    print(
        f"kvroute sim: {len(fleet.backends)} backend(s), profile {b0.profile.name}, "
        f"model {b0.model_name!r}, speedup {args.speedup:g}",
        flush=True,
    )
    for i, b in enumerate(fleet.backends):
        kv = f"  kv-events {b.kv_endpoint}" if b.kv_endpoint else ""
        replay = b.publisher.replay_endpoint if b.publisher else None
        kv += f"  replay {replay}" if replay else ""
        active = {k: v for k, v in b.faults.to_json().items() if v != Faults().to_json()[k]}
        extra = f"  faults {active}" if active else ""
        print(f"backend {i}: {b.url}{kv}{extra}", flush=True)
    await stop.wait()
    print("kvroute sim: shutting down", flush=True)
    await fleet.close()
    return 0
