"""What one real-vLLM run found: per mode and engine, the table and issue 10's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(slots=True)
class SaltStep:
    """One request of the cache_salt check."""

    salt: str | None  # the request's cache_salt
    decision: str  # the router's x-kvroute-decision
    hit_tokens: int  # Δ vllm:prefix_cache_hits_total over the fleet for this request


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
