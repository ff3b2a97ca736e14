"""What a router costs, side by side in one run: kvroute against the Rust peers.

Two measurements, each in ``--rounds`` interleaved rounds (the machine is shared and
noisy: every target gets a turn in every round, and the table shows medians):

- **overhead**: one canned backend (``kvroute.bench.fake_backend``: answers at once for
  almost no CPU), reached directly and through each router (kvroute's ``prefix`` policy,
  sglang-router's and vllm-router's ``cache_aware``), with wrk (one thread) sending one
  short completion: at 1 connection (added latency at P50/P99) and at ``--connections``
  (requests per second, and the ratio to sglang-router);
- **cpu**: ``--backends`` canned backends behind kvroute, wrk sending ranvier-stress chats
  (3,400 prompt tokens on average; the last message made unique in every request, so
  only the shared context repeats): the router's CPU time per request, in approximate
  mode and, when ``--tokenizer DIR`` (a ``tokenizer.json``) is given or the tiny model of
  ``scripts/real_vllm/setup.sh`` is present, in exact mode with that tokenizer.

Both also run floors (``--no-floors`` skips them): ``kvroute.bench.perf.bare_proxy``,
an aiohttp proxy that does nothing but forward (what any aiohttp router pays); in the
overhead table the same proxy on granian's Rust server (``bare_proxy_rsgi``, when granian
is installed); in the cpu table, kvroute with ``round_robin`` (every step but the
placement choice).

Client, routers and backends share the machine's cores, as they would on one host;
compare rows with each other, not with other machines.

    python -m kvroute.bench.perf.router_cost [--rounds 3] [--duration 10]
        [--peers sglang,vllm-router] [--skip-overhead] [--skip-cpu]

(``scripts/bench_router_cost.py`` runs the same; needs ``wrk``.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from kvroute.bench.perf.clients import WrkResult, measure_throughput, request_bodies, wrk
from kvroute.bench.perf.workers import child, minimal_fleet, router
from kvroute.bench.procs import RouterUnavailable, free_port, parse_router, router_command
from kvroute.common.text_table import text_table

SHORT = [("/v1/completions", b'{"model":"m","prompt":"You are a helpful assistant. Answer '
          b'briefly: what is prefix caching?","max_tokens":1}')]  # fmt: skip
TINY_MODEL = Path(".venv-vllm/models/tiny")
FLOOR = "aiohttp floor (bare proxy)"  # kvroute.bench.perf.bare_proxy: no routing at all
RSGI_FLOOR = "granian floor (bare proxy)"  # the same on granian's server (bare_proxy_rsgi)


@contextlib.contextmanager
def bare_proxy(
    backends: list[str], logs: Path, module: str = "bare_proxy"
) -> Iterator[tuple[str, int]]:
    """``kvroute.bench.perf.<module>`` (a proxy and nothing else): (its URL, its pid)."""
    port = free_port()
    cmd = [sys.executable, "-m", f"kvroute.bench.perf.{module}", str(port), *backends]
    with child(module.replace("_", "-"), cmd, logs) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready_sync([url + "/health"], 30)
        assert proc.pid is not None
        yield url, proc.pid


@contextlib.contextmanager
def peer(name: str, backend: str, logs: Path) -> Iterator[str]:
    """A peer router (``sglang``, ``vllm-router``) with its cache-aware policy."""
    port = free_port()
    with child(name, router_command(parse_router(name), [backend], port), logs) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready_sync([url + "/health"], 60)
        yield url


def run_overhead(args: argparse.Namespace, logs: Path) -> None:
    with contextlib.ExitStack() as stack:
        (backend,) = stack.enter_context(minimal_fleet(1, logs))
        targets = {"direct": backend}
        url, _ = stack.enter_context(router([backend], 1, args.policy, logs))
        targets["kvroute"] = url
        if args.floors:
            targets[FLOOR] = stack.enter_context(bare_proxy([backend], logs))[0]
            if importlib.util.find_spec("granian") is not None:
                proxy = bare_proxy([backend], logs, "bare_proxy_rsgi")
                targets[RSGI_FLOOR] = stack.enter_context(proxy)[0]
            else:
                print(f"  skipping {RSGI_FLOOR}: pip install granian", file=sys.stderr)
        for name in args.peers:
            try:
                targets[name] = stack.enter_context(peer(name, backend, logs))
            except RouterUnavailable as exc:
                print(f"  skipping {name}: {exc}", file=sys.stderr)
        one: dict[str, list[WrkResult]] = defaultdict(list)
        many: dict[str, list[WrkResult]] = defaultdict(list)
        for k in range(args.rounds):
            for name, url in targets.items():
                wrk(url, 4, 1.0, SHORT)  # warm the connections and the code paths
                one[name].append(wrk(url, 1, args.duration, SHORT))
                many[name].append(wrk(url, args.connections, args.duration, SHORT))
            print(f"  round {k + 1}/{args.rounds}: " + ", ".join(
                f"{n} {many[n][-1].rps:,.0f} req/s" for n in targets), flush=True)  # fmt: skip
    print(f"\noverhead: one canned backend, short completion, wrk -t1, {args.duration:g} s "
          f"per cell, median of {args.rounds} interleaved rounds")  # fmt: skip
    base_p50 = _median(one["direct"], "p50_ms")
    ref = "sglang" if "sglang" in many else None
    head = ["path", "1 conn p50 ms", "p99 ms", "added p50 ms", f"{args.connections} conn req/s"]
    rows = []
    for name in targets:
        p50, rps = _median(one[name], "p50_ms"), _median(many[name], "rps")
        row = [name, f"{p50:.3f}", f"{_median(one[name], 'p99_ms'):.3f}",
               "" if name == "direct" else f"{p50 - base_p50:.3f}", f"{rps:,.0f}"]  # fmt: skip
        if ref is not None:
            row.append(f"{rps / _median(many[ref], 'rps'):.2f}x")
        rows.append(row)
    if ref is not None:
        head.append("vs sglang-router")
    print(text_table([head, *rows]))


def run_cpu(args: argparse.Namespace, logs: Path) -> None:
    tokenizer = args.tokenizer or (
        TINY_MODEL if (TINY_MODEL / "tokenizer.json").is_file() else None
    )
    # row -> kvroute's policy and flags, or None for the bare aiohttp proxy
    rows: dict[str, tuple[str, list[str]] | None] = {}
    if "approximate" in args.modes:
        rows[f"kvroute {args.policy}, approximate"] = (args.policy, [])
    if "exact" in args.modes and tokenizer is not None:
        exact = ["--mode", "exact", "--tokenizer", f"m={tokenizer}"]
        rows[f"kvroute {args.policy}, exact"] = (args.policy, exact)
    elif "exact" in args.modes:
        print("  no tokenizer (--tokenizer DIR): exact mode skipped", file=sys.stderr)
    if args.floors:
        rows["kvroute round_robin, approximate (no choice)"] = ("round_robin", [])
        rows[FLOOR] = None
    bodies = request_bodies("ranvier-stress", "m", unique=True)
    cpu: dict[str, list[float]] = defaultdict(list)
    rps: dict[str, list[float]] = defaultdict(list)
    with minimal_fleet(args.backends, logs) as urls:
        for k in range(args.rounds):
            for name, spec in rows.items():
                with (
                    bare_proxy(urls, logs)
                    if spec is None
                    else router(urls, 1, spec[0], logs, extra=spec[1])
                ) as (url, pid):
                    r, _, us = measure_throughput(url, pid, bodies, client="wrk",
                        connections=args.connections, duration_s=args.duration)  # fmt: skip
                rps[name].append(r)
                cpu[name].append(us)
            print(f"  round {k + 1}/{args.rounds}: " + ", ".join(
                f"{n} {cpu[n][-1]:.0f} us" for n in rows), flush=True)  # fmt: skip
    print(f"\ncpu: {args.backends} canned backends, ranvier-stress chats (new last turns), "
          f"wrk -t1 -c{args.connections}, {args.duration:g} s per cell, "
          f"median of {args.rounds} rounds")  # fmt: skip
    table = [[n, f"{statistics.median(cpu[n]):.0f}", f"{min(cpu[n]):.0f}-{max(cpu[n]):.0f}",
              f"{statistics.median(rps[n]):,.0f}"] for n in rows]  # fmt: skip
    print(text_table([["router", "CPU us/request", "range", "req/s"], *table]))
    if tokenizer is not None and "exact" in args.modes:
        print(f"(exact mode tokenizer: {tokenizer})")


def _median(results: list[WrkResult], field: str) -> float:
    return float(statistics.median(getattr(r, field) for r in results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--backends", type=int, default=8, help="for the cpu measurement")
    ap.add_argument("--peers", default="sglang,vllm-router",
                    help="peer routers to run beside kvroute ('' for none)")  # fmt: skip
    ap.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json (exact mode)")
    ap.add_argument("--policy", default="prefix", help="kvroute's policy")
    ap.add_argument("--modes", default="approximate,exact", help="for the cpu measurement")
    ap.add_argument("--no-floors", dest="floors", action="store_false",
                    help="skip the bare proxies and kvroute round_robin rows")  # fmt: skip
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    if shutil.which("wrk") is None:
        ap.error("needs wrk (apt install wrk)")
    with tempfile.TemporaryDirectory(prefix="kvroute-cost-") as folder:
        if not args.skip_overhead:
            run_overhead(args, Path(folder))
        if not args.skip_cpu:
            run_cpu(args, Path(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
