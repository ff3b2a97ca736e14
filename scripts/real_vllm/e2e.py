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
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from events import EventTracker
from fleet import (
    REPO,
    Proc,
    VllmOptions,
    cache_info,
    engine_counters,
    free_port,
    http,
    reset_prefix_cache,
    spawn,
    start_vllm,
    stop,
    tokenize,
    wait_healthy,
)

ADMIN_KEY = "real-vllm-e2e-admin"
MODES = ("exact", "approx", "round_robin")
SETTLE_S = 4.0  # after a run, before comparing the router's view with the events
POLICY_OF = {"exact": "prefix", "approx": "prefix", "round_robin": "round_robin"}


@dataclass(slots=True)
class EngineRow:
    """One engine after one mode's run."""

    url: str  # engine base URL
    hit_tokens: int  # Δ vllm:prefix_cache_hits_total
    query_tokens: int  # Δ vllm:prefix_cache_queries_total
    event_blocks: int  # blocks the KV events say it holds now
    router_blocks: int | None  # blocks the router's index holds for it (None: unknown)
    router_predicted_hit_rate: float | None  # router's own prediction for this engine
    events_stored: int  # blocks in BlockStored events during the run
    events_removed: int  # blocks in BlockRemoved events during the run


@dataclass(slots=True)
class ModeResult:
    """One router mode's run."""

    mode: str  # exact | approx | round_robin
    status: str  # "ok", or why it did not run ("TODO: ...", "error: ...")
    stream: bool = True  # streaming clients (else non-streaming)
    run: int = 1  # which repetition (--repeat)
    requests: int = 0  # completed
    failures: int = 0  # failed
    hit_rate: float | None = None  # fleet Δhits / Δqueries from the engines' counters
    bench_hit_rate: float | None = None  # the same as kvroute bench computed it
    duration_s: float | None = None  # bench wall time
    view_matches_events: bool | None = None  # every engine: router_blocks == event_blocks
    engines: list[EngineRow] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Workload:
    """The shared-prefix chat workload (zipf-hot with near-uniform popularity)."""

    num_prompts: int  # distinct system prompts
    prefix_tokens: int  # words per system prompt (about one BPE token each)
    suffix_tokens: int  # words of each unique user message
    output_tokens: int  # max_tokens, with ignore_eos
    requests: int  # measured requests per mode
    concurrency: int  # closed-loop users
    seed: int  # workload seed (same prompts in every mode)

    def params(self) -> dict[str, str]:
        return {
            "num_prefixes": str(self.num_prompts),
            "prefix_tokens": str(self.prefix_tokens),
            "suffix_tokens": str(self.suffix_tokens),
            "output_tokens": str(self.output_tokens),
            "zipf_s": "0.01",  # near-uniform popularity
        }

    def bench_args(self, stream: bool = True) -> list[str]:
        args = ["--workload", "zipf-hot", "--seed", str(self.seed)]
        for key, value in self.params().items():
            args += ["--workload-arg", f"{key}={value}"]
        args += ["--concurrency", str(self.concurrency), "--num-requests", str(self.requests)]
        args += [] if stream else ["--no-stream"]
        return [*args, "--ignore-eos", "--no-plots", "--quiet", "--timeout", "120"]

    def messages(self) -> Iterator[list[dict[str, str]]]:
        """The chat messages of the measured requests, in the order they are sent."""
        from kvroute.bench.workloads import make_workload

        made = make_workload("zipf-hot", seed=self.seed, overrides=self.params())
        n = 0
        for session in made.sessions():
            for spec in session:
                if n == self.requests:
                    return
                assert spec.messages is not None, "zipf-hot sends chat requests"
                yield [{"role": r, "content": c} for r, c in spec.messages]
                n += 1


def ceiling_hit_rate(token_lists: list[list[int]], block_size: int) -> float:
    """The engine hit rate with an infinite cache: each request hits every full block of
    its prefix that an earlier request computed (vLLM recomputes at least the last
    token, so a prompt never hits whole)."""
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for ids in token_lists:
        usable = (len(ids) - 1) // block_size  # blocks that may be hits
        matched = 0
        while matched < usable and tuple(ids[: (matched + 1) * block_size]) in seen:
            matched += 1
        hits += matched * block_size
        queries += len(ids)
        for k in range(1, len(ids) // block_size + 1):
            seen.add(tuple(ids[: k * block_size]))
    return hits / queries if queries else 0.0


def kvroute_bin() -> Path:
    return Path(sys.executable).parent / "kvroute"


def router_env(venv: Path, run_dir: Path) -> dict[str, str]:
    """The router's environment; borrows tokenizers + jinja2 from the vLLM venv if needed.

    Exact keys on a real model need both packages in the router's Python. When they are
    missing there and the vLLM venv has the same Python version, a folder of symlinks to
    just those packages goes first on the router's PYTHONPATH (nothing is installed).
    """
    env = dict(os.environ)
    probe = [sys.executable, "-c", "import tokenizers, jinja2"]
    if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return env
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = (venv / "lib" / version / "site-packages").resolve()
    names = ("tokenizers", "jinja2", "markupsafe")
    if not all((site / n).is_dir() for n in names):
        return env
    extras = run_dir / "router-extras"
    extras.mkdir(exist_ok=True)
    for name in names:
        if not (extras / name).exists():
            (extras / name).symlink_to(site / name, target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extras), env.get("PYTHONPATH")) if p)
    return env


def exact_mode_missing(env: dict[str, str]) -> str | None:
    """Why the router cannot run exact mode on this model, or None when it can.

    Needs ``kvroute serve --mode`` and, for a real model's token ids, ``tokenizers`` and
    ``jinja2`` importable by the router (see ``router_env``).
    """
    out = subprocess.run(
        [str(kvroute_bin()), "serve", "--help"], capture_output=True, text=True, check=False
    )
    if "--mode" not in out.stdout:
        return "TODO: kvroute serve has no --mode exact yet"
    probe = [sys.executable, "-c", "import tokenizers, jinja2"]
    if subprocess.run(probe, capture_output=True, check=False, env=env).returncode != 0:
        return f"TODO: exact keys need tokenizers + jinja2 in {Path(sys.executable).parent.parent}"
    return None


def router_config(engines: list[Proc], model_dir: Path, path: Path) -> Path:
    """YAML for exact mode: each backend with its KV-event endpoint, the model's tokenizer."""
    lines = ["mode: exact", "tokenizers:", f"  tiny: {model_dir.resolve()}", "backends:"]
    for e in engines:
        lines += [f"  - url: {e.url}", f"    kv_events: {e.kv_endpoint}"]
        lines += [f"    kv_replay: {e.kv_replay}"] if e.kv_replay else []
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class RouterSetup:
    """What every router start needs besides the mode."""

    model_dir: Path  # the model's tokenizer (exact keys)
    env: dict[str, str]  # the router's environment (router_env)
    run_dir: Path  # logs and generated configs


def start_router(mode: str, engines: list[Proc], setup: RouterSetup) -> Proc:
    port = free_port()
    argv = [str(kvroute_bin()), "serve", "--port", str(port), "--policy", POLICY_OF[mode]]
    argv += ["--admin-key", ADMIN_KEY, "--log-level", "WARNING"]
    if mode == "exact":
        config = router_config(engines, setup.model_dir, setup.run_dir / "exact.yaml")
        argv += ["--mode", "exact", "--config", str(config)]
    else:
        for e in engines:
            argv += ["--backend", e.url]
    url = f"http://127.0.0.1:{port}"
    return spawn(f"router-{mode}", argv, setup.env, setup.run_dir, url)


def admin_rows(router: Proc) -> list[dict[str, Any]]:
    body = http("GET", f"{router.url}/admin/backends", Authorization=f"Bearer {ADMIN_KEY}")
    return list(body["backends"])


def wait_router_ready(router: Proc, n: int, timeout_s: float = 60.0) -> None:
    """Healthy, and every backend scraped once (so block size and capacity are known)."""
    wait_healthy([router], timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = admin_rows(router)
        ready = [
            r
            for r in rows
            if r["kvroute_backend_healthy"] and r["kvroute_backend_engine_kv_usage"] is not None
        ]
        if len(ready) == n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"router backends not ready after {timeout_s:.0f} s:\n{router.log_tail()}")


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
    router: Proc, engines: list[Proc], wl: Workload, mode: str, out: Path, stream: bool
) -> dict:
    argv = [str(kvroute_bin()), "bench", "--target", router.url, "--router", mode]
    argv += ["--out", str(out), "--model", "tiny", *wl.bench_args(stream)]
    argv += ["--backend-metrics", *(e.url for e in engines)]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False, cwd=REPO)
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
        result = run_bench(router, engines, wl, mode, setup.run_dir / name, stream)
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


@dataclass(slots=True)
class SaltStep:
    """One request of the cache_salt check."""

    salt: str | None  # the request's cache_salt
    decision: str  # the router's x-kvroute-decision
    hit_tokens: int  # Δ vllm:prefix_cache_hits_total over the fleet for this request


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


def ensure_model(venv: Path, model_dir: Path) -> None:
    if (model_dir / "tokenizer.json").exists():
        return
    script = Path(__file__).resolve().parent / "make_model.py"
    subprocess.run([str(venv / "bin" / "python"), str(script), "--out", str(model_dir)], check=True)


STREAM_KINDS = {"both": (True, False), "stream": (True,), "no-stream": (False,)}


def run_all(
    args: argparse.Namespace, wl: Workload, run_dir: Path
) -> tuple[list[ModeResult], dict | None, float | None]:
    """Start the engines once; run every repetition, client kind and mode (and the salt
    check); stop everything. Also returns the workload's ceiling hit rate."""
    opts = VllmOptions(
        venv=args.venv,
        model_dir=args.model_dir,
        num_gpu_blocks=args.num_gpu_blocks or None,
        kv_transport=args.kv_transport,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
    )
    ensure_model(args.venv, args.model_dir)
    engines: list[Proc] = []
    trackers: list[EventTracker] = []
    results: list[ModeResult] = []
    salt: dict | None = None
    ceiling: float | None = None
    try:
        engines = [start_vllm(i, opts, run_dir) for i in range(args.servers)]
        trackers = [EventTracker(e.kv_endpoint or "") for e in engines]
        for t in trackers:
            t.start()
        t0 = time.monotonic()
        wait_healthy(engines, args.startup_timeout)
        info = cache_info(engines[0].url)
        print(
            f"{len(engines)} engines healthy in {time.monotonic() - t0:.0f} s; "
            f"block_size={info.get('block_size')} num_gpu_blocks={info.get('num_gpu_blocks')}",
            flush=True,
        )
        ids = [tokenize(engines[0].url, "tiny", m) for m in wl.messages()]
        ceiling = ceiling_hit_rate(ids, int(info.get("block_size") or args.block_size))
        mean_len = sum(map(len, ids)) / max(1, len(ids))
        print(f"ceiling (infinite cache) {ceiling:.3f}; mean prompt {mean_len:.0f} tokens")
        setup = RouterSetup(args.model_dir, router_env(args.venv, run_dir), run_dir)
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


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def format_table(results: list[ModeResult]) -> str:
    """One line per mode, then one per engine: truth (events) vs the router's view."""
    out = [
        f"{'run':>3} {'clients':<9} {'mode':<12} {'hit rate':>9} {'(bench)':>9} "
        f"{'requests':>8} {'failed':>6} {'time s':>7}  view==events  status"
    ]
    for r in results:
        view = "-" if r.view_matches_events is None else str(r.view_matches_events).lower()
        kind = "stream" if r.stream else "whole"
        out.append(
            f"{r.run:>3} {kind:<9} {r.mode:<12} {_pct(r.hit_rate):>9} "
            f"{_pct(r.bench_hit_rate):>9} {r.requests:>8} {r.failures:>6} "
            f"{r.duration_s or 0:>7.1f}  {view:<12}  {r.status}"
        )
    out.append("")
    out.append(
        f"{'run':>3} {'clients':<9} {'mode':<12} {'engine':<24} {'hit/query tokens':>18} "
        f"{'events':>7} {'router':>7}"
    )
    for r in results:
        kind = "stream" if r.stream else "whole"
        for e in r.engines:
            ratio = f"{e.hit_tokens}/{e.query_tokens}"
            out.append(
                f"{r.run:>3} {kind:<9} {r.mode:<12} {e.url:<24} {ratio:>18} "
                f"{e.event_blocks:>7} {'-' if e.router_blocks is None else e.router_blocks:>7}"
            )
    return "\n".join(out)


def verdict(results: list[ModeResult], ceiling: float | None) -> tuple[str, bool]:
    """Issue 10's bar, per run and client kind: kvroute (exact and approximate) at or
    above 0.85 x the ceiling and at least 0.10 above round-robin."""
    lines = [f"{'run':>3} {'clients':<9} {'round_robin':>11} {'approx':>8} {'exact':>8} "
             f"{'ceiling':>8}  verdict"]  # fmt: skip
    ok = True
    keys = sorted({(r.run, r.stream) for r in results}, key=lambda k: (k[0], not k[1]))
    for run, stream in keys:
        rate = {r.mode: r.hit_rate for r in results if (r.run, r.stream) == (run, stream)}
        rr = rate.get("round_robin")
        checks = []
        for mode in ("approx", "exact"):
            hr = rate.get(mode)
            if hr is None or rr is None or ceiling is None:
                continue
            checks.append(hr >= 0.85 * ceiling and hr >= rr + 0.10)
        good = bool(checks) and all(checks)
        ok = ok and good
        lines.append(
            f"{run:>3} {'stream' if stream else 'whole':<9} {_rate(rr):>11} "
            f"{_rate(rate.get('approx')):>8} {_rate(rate.get('exact')):>8} "
            f"{_rate(ceiling):>8}  {'ok' if good else 'BELOW'}"
        )
    return "\n".join(lines), ok


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=2, help="vLLM engines (2-3 fit in 24 GB)")
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-vllm")
    ap.add_argument("--model-dir", type=Path, default=REPO / ".venv-vllm" / "models" / "tiny")
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
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if not (args.venv / "bin" / "python").exists():
        ap.error(f"no vLLM venv at {args.venv}: run scripts/real_vllm/setup.sh")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
