"""CPU a worker spends replaying one peer request (``FleetBus.apply``), in-process.

With ``kvroute serve --workers N`` every request is replayed by the N - 1 other workers
(router/worker_sync.py). This times the replay of one request's messages (dispatch,
first token, cached tokens, finish; as a peer sends them, one frame per request) on a
Fleet of 8 backends, for the first 256 requests of a workload (text keys, 16-token
blocks, like approximate mode) and for 64 short prompts. Socket costs are not included.

    python -m kvroute.bench.perf.bus [--workload ranvier-stress] [--requests 20000]

(``scripts/bench_bus.py`` runs the same.)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time

import msgspec
import zmq.asyncio

from kvroute.bench.workloads import make_workload
from kvroute.common.hashing import text_block_hashes
from kvroute.core.fleet import Fleet
from kvroute.core.keys import CHARS_PER_TOKEN
from kvroute.core.policy import make_policy
from kvroute.router.worker_sync import BusSpec, FleetBus

BLOCK_SIZE = 16
URLS = [f"http://10.0.0.{i}:8000" for i in range(8)]


def prompts(workload: str) -> list[tuple[str, int]]:
    """(prompt text, prompt tokens) of 256 requests of ``workload``, or 64 short ones."""
    if workload == "short":
        return [(f"Conversation {k}: the quick brown fox jumps. " * 4, 40) for k in range(64)]
    specs = itertools.islice(make_workload(workload, seed=0).requests(), 256)
    return [(s.prompt_text(), s.num_prompt_tokens) for s in specs]


def frames(texts: list[tuple[str, int]], count: int) -> list[bytes]:
    """``count`` frames from peer worker 1, each holding one request's four messages."""
    keys = [text_block_hashes(t, BLOCK_SIZE * CHARS_PER_TOKEN) for t, _ in texts]
    out = []
    for i in range(count):
        k = i % len(texts)
        url, now = URLS[k % len(URLS)], 1.0 + i * 1e-3
        out.append(msgspec.msgpack.encode([
            (0, 1, 999, i, url, "prefix", f"r{i}", None, keys[k], texts[k][1], 1, now),
            (1, 1, 999, i, now + 5e-4, 0),
            (2, 1, 999, i, 0),
            (3, 1, 999, i, now + 6e-4, True),
        ]))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="ranvier-stress")
    p.add_argument("--requests", type=int, default=20_000)
    args = p.parse_args(argv)
    context = zmq.asyncio.Context()
    for workload in (args.workload, "short"):
        texts = prompts(workload)
        fleet = Fleet(make_policy("prefix"))
        for url in URLS:
            fleet.add_backend(url)
        with tempfile.TemporaryDirectory() as folder:
            bus = FleetBus(BusSpec(folder, 0, 2), fleet, context)
            batch = frames(texts, args.requests)
            for frame in batch[:1000]:  # warm-up: the index fills
                bus.apply(frame, 0.0)
            t0 = time.perf_counter()
            for frame in batch[1000:]:
                bus.apply(frame, 0.0)
            per_us = (time.perf_counter() - t0) / (len(batch) - 1000) * 1e6
            bus.close()
        blocks = sum(len(t) for t, _ in texts) / len(texts) / (BLOCK_SIZE * CHARS_PER_TOKEN)
        print(f"{workload:<16} {blocks:6.0f} blocks/request  {per_us:6.1f} us per replayed request")
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
