"""kvroute in front of real vLLM CPU engines: engine-measured prefix hit rate per router mode.

Starts N vLLM servers (prefix caching, ZMQ KV events, dummy weights of a tiny model
made by make_model.py), then for each mode starts a fresh ``kvroute serve`` in front,
empties every engine's prefix cache, runs a shared-prefix chat workload with
``kvroute bench`` and reads the hit rate from vLLM's own counters (Δhits / Δqueries,
tokens, summed over the fleet). A subscriber per engine keeps the set of blocks the KV
events say the engine holds; after each run it is compared with the router's view
(``/admin/backends`` ``kvroute_backend_index_blocks``): in exact mode they must match.
Each mode runs with streaming clients and with non-streaming ones (the openai SDK's
default), ``--repeat`` times in a row; the ceiling is the hit rate an infinite cache would
give the same requests, from vLLM's own tokenizer (``/tokenize``). The default workload
is the one of issue 10: 6 system prompts of about 1.2k tokens, 72 chat requests, 4
users, block size 32 and each engine's KV holding about half of the prompts.
Last, a ``cache_salt`` check in exact mode: one system prompt salted, unsalted, salted
again; only the third may hit in vLLM, and the router must predict exactly that.

Run with the main venv (it has kvroute); the engines run from .venv-vllm:

    scripts/real_vllm/setup.sh
    .venv/bin/python scripts/real_vllm/e2e.py                      # 2 engines, 72 requests
    .venv/bin/python scripts/real_vllm/e2e.py --repeat 5 --json out.json

Every process it starts is stopped on exit (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvroute.bench.real_vllm.engines import (
    Proc,
    VllmOptions,
    cache_info,
    engine_counters,
    http,
    reset_prefix_cache,
    start_vllm,
    stop,
    tokenize,
    wait_healthy,
)
from kvroute.bench.real_vllm.events import EventTracker
from kvroute.bench.real_vllm.results import (
    EngineRow,
    ModeResult,
    SaltStep,
    format_table,
    verdict,
)
from kvroute.bench.real_vllm.routers import (
    RouterSetup,
    admin_rows,
    exact_mode_missing,
    kvroute_bin,
    router_env,
    start_router,
    wait_router_ready,
)
from kvroute.bench.real_vllm.workload import Workload, ceiling_hit_rate

MODES = ("exact", "approx", "round_robin")
SETTLE_S = 4.0  # after a run, before comparing the router's view with the events


def cold_start(engines: list[Proc], trackers: list[EventTracker]) -> None:
    """Empty every prefix cache and wait until the event streams say so too.

    vLLM queues the AllBlocksCleared event of ``/reset_prefix_cache`` and publishes it at
    the engine's next scheduler step, so a one-token request per engine flushes it.
    """
    for e in engines:
        reset_prefix_cache(e.url)
        nudge = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
        http("POST", f"{e.url}/v1/completions", nudge, timeout_s=60.0)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if all(not t.snapshot().live_blocks for t in trackers):
            return
        time.sleep(0.2)
    raise RuntimeError("KV events still show blocks after /reset_prefix_cache")


def run_bench(
    router: Proc, engines: list[Proc], wl: Workload, mode: str, out: Path, stream: bool, cwd: Path
) -> dict:
    argv = [str(kvroute_bin()), "bench", "--target", router.url, "--router", mode]
    argv += ["--out", str(out), "--model", "tiny", *wl.bench_args(stream)]
    argv += ["--backend-metrics", *(e.url for e in engines)]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"kvroute bench failed ({done.returncode}); see {log}")
    return json.loads((out / "result.json").read_text())


def run_mode(
    mode: str,
    engines: list[Proc],
    trackers: list[EventTracker],
    wl: Workload,
    setup: RouterSetup,
    *,
    stream: bool = True,
    run: int = 1,
) -> ModeResult:
    """One fresh router, cold engines, one workload run; the engines keep running."""
    cold_start(engines, trackers)
    before = [engine_counters(e.url) for e in engines]
    events_before = [t.snapshot() for t in trackers]
    router = start_router(mode, engines, setup)
    try:
        wait_router_ready(router, len(engines))
        t0 = time.monotonic()
        name = f"bench-{mode}-{'stream' if stream else 'whole'}-{run}"
        result = run_bench(router, engines, wl, mode, setup.run_dir / name, stream, setup.repo)
        duration = time.monotonic() - t0
        # Let the last events reach the router and the trackers, and (exact mode) the
        # router's speculative credits (speculative_ttl_s, 3 s by default) expire.
        time.sleep(SETTLE_S)
        rows = {r["url"]: r for r in admin_rows(router)}
    finally:
        stop(router)
    after = [engine_counters(e.url) for e in engines]
    res = ModeResult(
        mode,
        "ok",
        stream,
        run,
        int(result.get("completed", 0)),
        int(result.get("failed", 0)),
    )
    res.bench_hit_rate = result.get("engine_prefix_hit_rate")
    res.duration_s = round(duration, 1)
    for e, t, b, a, eb in zip(engines, trackers, before, after, events_before, strict=True):
        snap, row = t.snapshot(), rows.get(e.url, {})
        res.engines.append(
            EngineRow(
                e.url,
                int(a.prefix_cache_hits - b.prefix_cache_hits),
                int(a.prefix_cache_queries - b.prefix_cache_queries),
                len(snap.live_blocks),
                row.get("kvroute_backend_index_blocks"),
                row.get("kvroute_backend_predicted_hit_rate"),
                snap.stored - eb.stored,
                snap.removed - eb.removed,
            )
        )
    hits = sum(r.hit_tokens for r in res.engines)
    queries = sum(r.query_tokens for r in res.engines)
    res.hit_rate = hits / queries if queries else None
    res.view_matches_events = all(r.router_blocks == r.event_blocks for r in res.engines)
    return res


SALT_STEPS = (("tenant-a", "First question?"), (None, "Second question?"),
              ("tenant-a", "Third question?"))  # fmt: skip


def salt_check(engines: list[Proc], trackers: list[EventTracker], setup: RouterSetup) -> dict:
    """Exact mode with vLLM's ``cache_salt``: the same system prompt salted, unsalted, then
    salted again. vLLM mixes the salt into the first block (and names it in the event's
    extra keys), so only the third may hit; the router must predict exactly that."""
    cold_start(engines, trackers)
    router = start_router("exact", engines, setup)
    system = " ".join(f"rule {i} of the salted tenant is to answer briefly." for i in range(60))
    steps: list[SaltStep] = []
    try:
        wait_router_ready(router, len(engines))
        for salt, question in SALT_STEPS:
            body: dict[str, Any] = {
                "model": "tiny",
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}],
                "max_tokens": 2,
            }  # fmt: skip
            if salt is not None:
                body["cache_salt"] = salt
            before = [engine_counters(e.url).prefix_cache_hits for e in engines]
            req = urllib.request.Request(
                f"{router.url}/v1/chat/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                decision = resp.headers.get("x-kvroute-decision", "")
                resp.read()
            after = [engine_counters(e.url).prefix_cache_hits for e in engines]
            hits = int(sum(a - b for a, b in zip(after, before, strict=True)))
            steps.append(SaltStep(salt, decision, hits))
            time.sleep(SETTLE_S)  # events in, speculative credit (3 s TTL) gone
    finally:
        stop(router)
    decisions = [st.decision for st in steps]
    hit = [st.hit_tokens > 0 for st in steps]
    ok = decisions == ["cold", "cold", "prefix"] and hit == [False, False, True]
    return {"ok": ok, "steps": [asdict(st) for st in steps]}


def ensure_model(venv: Path, model_dir: Path, script: Path) -> None:
    """Make the tiny model with the vLLM venv's Python (it has tokenizers), once."""
    if (model_dir / "tokenizer.json").exists():
        return
    subprocess.run([str(venv / "bin" / "python"), str(script), "--out", str(model_dir)], check=True)


STREAM_KINDS = {"both": (True, False), "stream": (True,), "no-stream": (False,)}


def run_all(
    args: argparse.Namespace, wl: Workload, run_dir: Path
) -> tuple[list[ModeResult], dict | None, float | None]:
    """Start the engines once; run every repetition, client kind and mode (and the salt
    check); stop everything. Also returns the workload's ceiling hit rate."""
    scripts = args.repo / "scripts" / "real_vllm"
    opts = VllmOptions(
        venv=args.venv,
        model_dir=args.model_dir,
        launcher=scripts / "vllm_serve.py",
        num_gpu_blocks=args.num_gpu_blocks or None,
        kv_transport=args.kv_transport,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
    )
    ensure_model(args.venv, args.model_dir, scripts / "make_model.py")
    engines: list[Proc] = []
    trackers: list[EventTracker] = []
    results: list[ModeResult] = []
    salt: dict | None = None
    ceiling: float | None = None
    try:
        engines = [start_vllm(i, opts, run_dir, args.repo) for i in range(args.servers)]
        trackers = [EventTracker(e.kv_endpoint or "") for e in engines]
        for t in trackers:
            t.start()
        t0 = time.monotonic()
        wait_healthy(engines, args.startup_timeout)
        block_size, num_gpu_blocks = cache_info(engines[0].url)
        print(
            f"{len(engines)} engines healthy in {time.monotonic() - t0:.0f} s; "
            f"block_size={block_size} num_gpu_blocks={num_gpu_blocks}",
            flush=True,
        )
        ids = [tokenize(engines[0].url, "tiny", m) for m in wl.messages()]
        ceiling = ceiling_hit_rate(ids, block_size or args.block_size)
        mean_len = sum(map(len, ids)) / max(1, len(ids))
        print(f"ceiling (infinite cache) {ceiling:.3f}; mean prompt {mean_len:.0f} tokens")
        setup = RouterSetup(args.model_dir, router_env(args.venv, run_dir), run_dir, args.repo)
        exact_missing = exact_mode_missing(setup.env)
        for run in range(1, args.repeat + 1):
            for stream in STREAM_KINDS[args.clients]:
                for mode in args.modes:
                    kind = "streaming" if stream else "non-streaming"
                    if mode == "exact" and exact_missing:
                        results.append(ModeResult(mode, exact_missing, stream, run))
                        continue
                    print(f"run {run}: {mode}, {kind} clients ...", flush=True)
                    try:
                        results.append(
                            run_mode(mode, engines, trackers, wl, setup, stream=stream, run=run)
                        )
                    except RuntimeError as exc:
                        results.append(ModeResult(mode, f"error: {exc}", stream, run))
        if "exact" in args.modes and not exact_missing and not args.skip_salt_check:
            print("cache_salt check (exact mode) ...", flush=True)
            try:
                salt = salt_check(engines, trackers, setup)
            except (RuntimeError, OSError) as exc:
                salt = {"ok": False, "error": str(exc), "steps": []}
    finally:
        for t in trackers:
            t.stop()
        for e in engines:
            stop(e)
    return results, salt, ceiling


def parse_args(argv: list[str] | None, repo: Path) -> argparse.Namespace:
    """``repo``: the repository (``.venv-vllm`` and ``scripts/real_vllm`` live there)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=2, help="vLLM engines (2-3 fit in 24 GB)")
    ap.add_argument("--venv", type=Path, default=repo / ".venv-vllm")
    ap.add_argument("--model-dir", type=Path, default=repo / ".venv-vllm" / "models" / "tiny")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--num-prompts", type=int, default=6, help="shared system prompts")
    ap.add_argument("--prefix-tokens", type=int, default=1200)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=72, help="per mode")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=128,
        help="KV blocks per engine (--num-gpu-blocks-override; 128 x 32 tokens: about "
        "half of the default prompts); 0 = sized from 1 GB",
    )
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--clients",
        choices=tuple(STREAM_KINDS),
        default="both",
        help="streaming clients, non-streaming ones (the openai SDK's default), or both",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs in a row (same engines)")
    ap.add_argument("--kv-transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--startup-timeout", type=float, default=400.0, help="seconds")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the run folder")
    ap.add_argument("--skip-salt-check", action="store_true", help="no cache_salt check")
    args = ap.parse_args(argv)
    args.repo = repo
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if not (args.venv / "bin" / "python").exists():
        ap.error(f"no vLLM venv at {args.venv}: run scripts/real_vllm/setup.sh")
    return args


def main(argv: list[str] | None = None, *, repo: Path | None = None) -> int:
    """``repo``: the repository (default: the current directory)."""
    args = parse_args(argv, repo or Path.cwd())
    wl = Workload(
        args.num_prompts,
        args.prefix_tokens,
        args.suffix_tokens,
        args.output_tokens,
        args.requests,
        args.concurrency,
        args.seed,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
    print(f"logs in {run_dir}", flush=True)
    results, salt, ceiling = run_all(args, wl, run_dir)
    print(format_table(results))
    summary, bar_met = verdict(results, ceiling)
    print("\n" + summary)
    if salt is not None:
        steps = "; ".join(
            f"{st['salt'] or 'no salt'}: {st['decision']}, {st['hit_tokens']} hit tokens"
            for st in salt["steps"]
        )
        print(f"\ncache_salt check: {'ok' if salt['ok'] else 'FAILED'} ({steps or salt})")
    if args.json:
        doc = {
            "workload": asdict(wl),
            "ceiling": ceiling,
            "bar_met": bar_met,
            "results": [asdict(r) for r in results],
            "salt": salt,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    ok = all(r.status == "ok" or r.status.startswith("TODO") for r in results)
    ok = ok and (salt is None or salt["ok"])
    if ok and not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs kept in {run_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
