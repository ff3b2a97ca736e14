#!/usr/bin/env python3
"""Where a trace replay's returning conversations were served (bench/continuations.py).

    T=../shared/traces/mooncake_conversation_trace.jsonl
    kvroute simulate --workload mooncake --trace $T \\
      --backends 8 --profile llama-3.1-8b-a100 --routers kvroute,sglang-cache-aware --out runs/mc8
    python scripts/trace_continuations.py --trace $T runs/mc8/kvroute runs/mc8/sglang-cache-aware

Each RUN is a router's folder of a ``kvroute simulate`` or ``kvroute compare`` run of
the whole trace (one copy, no ``max_requests`` cut beyond the rows given here: pass the
same ``--max-rows``), holding its records.jsonl. ``--block-tokens``: 512 x the run's
``input_scale``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvroute.bench.compare_report import read_records
from kvroute.bench.continuations import continuation_stats, format_stats
from kvroute.bench.tracefile import read_mooncake_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="a router's folder with records.jsonl")
    ap.add_argument("--trace", required=True, help="the Mooncake-format trace replayed")
    ap.add_argument("--max-rows", type=int, default=0, help="the replay's max_requests")
    ap.add_argument("--block-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    rows = read_mooncake_trace(args.trace, args.max_rows)
    stats = {}
    for run in args.runs:
        path = Path(run) / "records.jsonl"
        if not path.is_file():
            ap.error(f"{run}: no records.jsonl")
        stats[run] = continuation_stats(rows, read_records(path), args.block_tokens)
    print(format_stats(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
