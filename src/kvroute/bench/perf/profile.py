"""Where the router's CPU goes: py-spy on ``kvroute serve`` under wrk, and a phase table.

Starts ``--backends`` canned backends (``kvroute.bench.fake_backend``) and one router
process, drives it with wrk (``--connections``; short completions or ranvier-stress chats
whose last turn is new every time), and samples the router with py-spy for
``--duration`` seconds: a flame graph (``--format flamegraph``, an SVG to open in a
browser) or collapsed stacks (``raw``). With ``raw`` it also prints the share of samples
in each phase of a request (parse, keys, routing, dispatch, the upstream client, ...).

    pip install py-spy        # not a dependency of kvroute: a profiler
    python -m kvroute.bench.perf.profile --bodies chats --backends 8 --out chats.svg
    python -m kvroute.bench.perf.profile --bodies chats --mode exact --format raw --out x.txt

(``scripts/profile_router.py`` runs the same; needs wrk and py-spy.)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from kvroute.bench.perf.clients import request_bodies, wrk
from kvroute.bench.perf.router_cost import SHORT, TINY_MODEL
from kvroute.bench.perf.workers import minimal_fleet, router
from kvroute.common.text_table import text_table

# (phase, function names that put a sample in it); the first match, leaf to root, wins
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "tokenizer (exact mode)",
        ("HfPromptTokenizer.start", "HfPromptTokenizer.token_ids", "PendingIds.finish"),
    ),
    ("routing: choose", ("Fleet.route",)),
    ("routing: dispatch", ("Fleet.dispatch",)),
    ("routing: first token, finish", ("Fleet.finish", "Fleet.on_first_token")),
    ("parse the body", ("parse_completion_body",)),
    ("block keys", ("_route_keys",)),
    ("upstream request (aiohttp client)", ("open_upstream",)),
    ("relay the answer", ("relay",)),
    ("request glue (ids, metrics, headers)", ("route_request", "_handle", "error_middleware")),
    ("HTTP server (aiohttp)", ("RequestHandler._handle_request", "RequestHandler.start")),
)


# leaf functions of a sample that waits (uvloop's run, a thread pool worker's queue)
_WAITING = frozenset({"Runner.run", "_worker", "Condition.wait", "Event.wait"})


def phase_shares(collapsed: str) -> list[tuple[str, float]]:
    """Share of samples per phase in py-spy's raw (collapsed) output."""
    counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        names = [re.sub(r" \(.*", "", frame) for frame in stack.split(";")]
        total += int(n)
        counts[_phase(names)] += int(n)
    return [(name, count / max(1, total)) for name, count in counts.most_common()]


def _phase(names: list[str]) -> str:
    if names[-1] in _WAITING:
        return "idle (event loop, thread pool)"
    present = set(names)
    for name, functions in PHASES:
        if present.intersection(functions):
            return name
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bodies", choices=("short", "chats"), default="chats")
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--mode", choices=("approximate", "exact"), default="approximate")
    ap.add_argument("--tokenizer", type=Path, default=TINY_MODEL, help="for exact mode")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of sampling")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--format", choices=("flamegraph", "raw"), default="flamegraph")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        ap.error("needs wrk (apt install wrk)")
    # py-spy installs into the environment's bin folder, which need not be on PATH
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        ap.error("needs py-spy (pip install py-spy)")
    flags = []
    if args.mode == "exact":
        if not (args.tokenizer / "tokenizer.json").is_file():
            ap.error(f"no tokenizer.json in {args.tokenizer} (scripts/real_vllm/setup.sh)")
        flags = ["--mode", "exact", "--tokenizer", f"m={args.tokenizer}"]
    bodies = SHORT if args.bodies == "short" else request_bodies("ranvier-stress", "m", unique=True)
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-profile-") as folder,
        minimal_fleet(args.backends, Path(folder)) as urls,
        router(urls, 1, "prefix", Path(folder), extra=flags) as (url, pid),
    ):
        wrk(url, 4, 2.0, bodies)  # warm up
        load = threading.Thread(
            target=wrk, args=(url, args.connections, args.duration + 3, bodies), daemon=True
        )
        load.start()
        time.sleep(1.0)
        cmd = [spy, "record", "-p", str(pid), "-d", f"{args.duration:g}", "-r",
               str(args.rate), "-f", args.format, "-o", str(args.out)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        load.join()
    print(f"wrote {args.out}")
    if args.format == "raw":
        rows = [[name, f"{share:.1%}"] for name, share in phase_shares(args.out.read_text())]
        print(text_table([["phase", "samples"], *rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
