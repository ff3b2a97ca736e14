"""Time Fleet.route + dispatch + finish for 32,000-token prompts on 8 and 1,024 backends.

Prints microseconds per decision. Seeded; run ``python -m kvroute.bench.perf.choose``
(or ``scripts/bench_choose.py``). Each prompt shares a 1,600-block prefix with one of 64
"documents" and has a unique 400-block tail, so matches are deep and the index holds
many entries.
"""

from __future__ import annotations

import argparse
import sys
import time
from random import Random

from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import RouteRequest, make_policy

BLOCK_SIZE = 16
PROMPT_TOKENS = 32_000
NUM_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE  # 2,000
SHARED_BLOCKS = 1_600


def make_requests(n: int, rng: Random) -> list[RouteRequest]:
    docs = [[rng.getrandbits(64) for _ in range(SHARED_BLOCKS)] for _ in range(64)]
    out = []
    for i in range(n):
        tail = [rng.getrandbits(64) for _ in range(NUM_BLOCKS - SHARED_BLOCKS)]
        out.append(RouteRequest(f"r{i}", None, docs[rng.randrange(64)] + tail, PROMPT_TOKENS, 128))
    return out


def bench(
    num_backends: int, policy: str, requests: list[RouteRequest], warmup: int
) -> tuple[float, float]:
    """Mean microseconds per decision: (route only, route + dispatch + finish)."""
    config = FleetConfig(default_capacity_blocks=100_000, max_index_entries=50_000_000)
    fleet = Fleet(make_policy(policy), config)
    for i in range(num_backends):
        fleet.add_backend(f"http://10.0.{i // 256}.{i % 256}:8000")
    in_flight = []
    now = 0.0
    route_s = total_s = 0.0
    for i, req in enumerate(requests):
        now += 0.01
        t0 = time.perf_counter()
        decision = fleet.route(req, now)
        t1 = time.perf_counter()
        assert decision is not None
        in_flight.append(fleet.dispatch(decision, req, now))
        if len(in_flight) > 4 * num_backends:  # keep ~4 requests per backend in flight
            old = in_flight.pop(0)
            fleet.on_first_token(old, now)
            fleet.finish(old, now, ok=True)
        t2 = time.perf_counter()
        if i >= warmup:
            route_s += t1 - t0
            total_s += t2 - t0
    n = len(requests) - warmup
    return route_s / n * 1e6, total_s / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--policy", default="prefix")
    args = parser.parse_args(argv)
    requests = make_requests(args.requests, Random(7))
    for n in (8, 1024):
        route_us, total_us = bench(n, args.policy, requests, warmup=args.requests // 3)
        print(
            f"policy={args.policy} backends={n} blocks={NUM_BLOCKS} "
            f"route={route_us:.0f} us route+dispatch+finish={total_us:.0f} us per decision"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
