"""Why a kvroute router won or lost: its decisions over time, what each kind cost, per backend.

Pure: measured records in, a ``DecisionAnalysis`` out (and its text table). Input is what
the client saw: ``RequestRecord.decision`` (the ``x-kvroute-decision`` header: ``prefix``,
``session``, ``cold``, ``load``, ``retry``), ``backend``, TTFT and the engine-reported
``usage.prompt_tokens_details.cached_tokens``. Routers that send no decision header give
no analysis (``analyze`` returns None).

Definitions, each over the measured records (warm-up left out):

- windows: the span from the first to the last send time cut into N equal parts; a request
  belongs to the window of its ``start_s`` (the last window includes its end);
- decision share: requests with that reason / requests with any reason, so the shares of
  a window sum to 1 (or the window has none);
- hit rate: sum cached_tokens / sum prompt_tokens over successful requests that reported
  cached_tokens (the engines' own count of each request; None when none reported);
- recomputed tokens: prompt_tokens - cached_tokens of such a request (what it prefilled);
- predicted hit rate: sum of the router's predicted cached tokens
  (``x-kvroute-predicted-cached-tokens``) / sum prompt_tokens over the same requests, beside
  the engines' count: a gap is a routing error (the router expected a hit that was not
  there), not a workload miss;
- left at home: sum of the hits predicted on the holders the requests were moved away from
  beyond those on their new backends (``x-kvroute-left-cached-tokens``) / the run's
  hit-rate denominator, in points of hit rate: what a kind of decision gave up by leaving
  its prefix's holder (``load``: the price of the diversions);
- TTFT percentiles: successful requests with a first token, ``np.percentile``, in ms;
- in flight per backend: requests between send and end of stream at once, seen by the
  client (queued and running on that backend): the peak, and the mean over the run;
- diversion trend: share of ``load`` in the last window minus share in the first. A
  "load spiral" (diversions recompute, the targets queue, holders look busier, more
  diversions) shows as a clearly positive trend while the P50 TTFT of the windows climbs;
  a flat mix stays near 0.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.bench.metrics import RequestRecord, measured, peak_concurrency

DEFAULT_WINDOWS = 5
DIVERSION = "load"  # the reason of a request sent away from its prefix's holder
# reasons in the order tables and plots show them; others follow alphabetically
REASON_ORDER = ("prefix", "session", "new", "cold", "load", "retry")


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One time window of the run."""

    start_s: float  # window start, seconds from the run start (send time)
    end_s: float  # window end
    num_requests: int  # measured requests sent in the window
    num_failed: int  # of those, not completed
    decision_share: dict[str, float]  # reason -> share of the decided requests; {} if none
    hit_rate: float | None  # engine-reported cached / prompt tokens of the window
    hit_rate_by_reason: dict[str, float]  # the same per reason (reasons that reported)
    p50_ttft_ms: float | None  # median TTFT of the window


@dataclass(frozen=True, slots=True)
class ReasonStats:
    """All measured requests routed for one reason: what that kind of decision cost."""

    num_requests: int  # requests with this reason
    share: float  # of all decided requests
    hit_rate: float | None  # engine-reported cached / prompt tokens
    mean_recomputed_tokens: float | None  # mean prompt - cached tokens of a request
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    predicted_hit_rate: float | None = None  # the router's predicted cached / prompt tokens
    left_hit_rate: float | None = None  # hits predicted at the homes left / run's prompt tokens


@dataclass(frozen=True, slots=True)
class BackendStats:
    """One backend as the client saw it."""

    backend: str  # x-kvroute-backend
    num_requests: int  # measured requests it served (or failed)
    share: float  # of the measured requests with a known backend
    hit_rate: float | None  # engine-reported cached / prompt tokens
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    peak_in_flight: int  # most of its requests between send and end at once
    mean_in_flight: float  # its request-seconds in flight / the run's span
    decisions: dict[str, int]  # reason -> requests sent to it for that reason


@dataclass(frozen=True, slots=True)
class DecisionAnalysis:
    """One router's decisions: over time, per reason, per backend, and the trend."""

    reasons: tuple[str, ...]  # reasons seen, in REASON_ORDER
    timeline: tuple[WindowStats, ...]  # the run's windows, in time order
    by_reason: dict[str, ReasonStats]  # reason -> totals
    by_backend: tuple[BackendStats, ...]  # sorted by backend
    diversion_trend: float | None  # load share, last window - first; None if undecided

    def to_json(self) -> dict[str, Any]:
        """compare.json's ``decision_analysis`` (plain dicts and lists)."""
        return dataclasses.asdict(self)


# --- small statistics ---------------------------------------------------------------


def _reported(records: Iterable[RequestRecord]) -> Iterator[RequestRecord]:
    """The successful requests whose engine reported cached tokens: every rate's base."""
    return (r for r in records if r.ok and r.cached_tokens is not None)


def hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """Sum cached / sum prompt tokens over successful requests that reported cached tokens."""
    cached = prompt = 0
    for r in _reported(records):
        cached += r.cached_tokens or 0
        prompt += r.prompt_tokens
    return cached / prompt if prompt > 0 else None


def _ttft_ms(records: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft_s * 1000.0 for r in records if r.ok and r.ttft_s is not None]


def _percentile(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def predicted_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """Sum predicted / sum prompt tokens over the requests ``hit_rate`` counts that carry
    the router's prediction (None when none does)."""
    predicted = prompt = 0
    for r in _reported(records):
        if r.predicted_cached_tokens is not None:
            predicted += r.predicted_cached_tokens
            prompt += r.prompt_tokens
    return predicted / prompt if prompt > 0 else None


def _left_tokens(records: Iterable[RequestRecord]) -> int | None:
    """Sum of the hits predicted at the homes left, over the requests ``hit_rate`` counts
    (None when none reports it: not a kvroute router)."""
    left = [r.left_cached_tokens for r in _reported(records) if r.left_cached_tokens is not None]
    return sum(left) if left else None


def _mean_recomputed(records: Iterable[RequestRecord]) -> float | None:
    recomputed = [r.prompt_tokens - (r.cached_tokens or 0) for r in _reported(records)]
    return sum(recomputed) / len(recomputed) if recomputed else None


def _ordered(reasons: Iterable[str]) -> tuple[str, ...]:
    seen = set(reasons)
    known = [r for r in REASON_ORDER if r in seen]
    return (*known, *sorted(seen - set(known)))


# --- the analysis -------------------------------------------------------------------


def _window_of(start_s: float, t0: float, width: float, n: int) -> int:
    if width <= 0:
        return 0
    return min(n - 1, int((start_s - t0) / width))


def _window(records: Sequence[RequestRecord], start_s: float, end_s: float) -> WindowStats:
    decided = Counter(r.decision for r in records if r.decision)
    total = sum(decided.values())
    by_reason: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.decision:
            by_reason[r.decision].append(r)
    hits = {reason: hit_rate(rs) for reason, rs in by_reason.items()}
    return WindowStats(
        start_s=start_s,
        end_s=end_s,
        num_requests=len(records),
        num_failed=sum(not r.ok for r in records),
        decision_share={k: decided[k] / total for k in _ordered(decided)} if total else {},
        hit_rate=hit_rate(records),
        hit_rate_by_reason={k: v for k in _ordered(hits) if (v := hits[k]) is not None},
        p50_ttft_ms=_percentile(_ttft_ms(records), 50),
    )


def _timeline(runs: Sequence[RequestRecord], num_windows: int) -> tuple[WindowStats, ...]:
    t0 = min(r.start_s for r in runs)
    t1 = max(r.start_s for r in runs)
    width = (t1 - t0) / num_windows
    buckets: list[list[RequestRecord]] = [[] for _ in range(num_windows)]
    for r in runs:
        buckets[_window_of(r.start_s, t0, width, num_windows)].append(r)
    return tuple(
        _window(bucket, t0 + i * width, t1 if i == num_windows - 1 else t0 + (i + 1) * width)
        for i, bucket in enumerate(buckets)
    )


def _reason_stats(runs: Sequence[RequestRecord]) -> dict[str, ReasonStats]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in runs:
        if r.decision:
            groups[r.decision].append(r)
    total = sum(len(g) for g in groups.values())
    # the run's hit-rate denominator: "left at home" is in points of the run's hit rate
    run_prompt = sum(r.prompt_tokens for r in _reported(runs))
    out = {}
    for reason in _ordered(groups):
        rs = groups[reason]
        ttft = _ttft_ms(rs)
        left = _left_tokens(rs)
        out[reason] = ReasonStats(
            num_requests=len(rs),
            share=len(rs) / total,
            hit_rate=hit_rate(rs),
            mean_recomputed_tokens=_mean_recomputed(rs),
            p50_ttft_ms=_percentile(ttft, 50),
            p99_ttft_ms=_percentile(ttft, 99),
            predicted_hit_rate=predicted_hit_rate(rs),
            left_hit_rate=None if left is None or not run_prompt else left / run_prompt,
        )
    return out


def _run_span_s(runs: Sequence[RequestRecord]) -> float:
    ends = [r.start_s + r.e2e_s for r in runs if r.e2e_s is not None]
    return max([*ends, *(r.start_s for r in runs)]) - min(r.start_s for r in runs)


def _backend_stats(runs: Sequence[RequestRecord]) -> tuple[BackendStats, ...]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in runs:
        if r.backend:
            groups[r.backend].append(r)
    total = sum(len(g) for g in groups.values())
    span_s = _run_span_s(runs)
    out = []
    for backend in sorted(groups):
        rs = groups[backend]
        ttft = _ttft_ms(rs)
        busy_s = sum(r.e2e_s for r in rs if r.e2e_s is not None)
        decisions = Counter(r.decision for r in rs if r.decision)
        out.append(
            BackendStats(
                backend=backend,
                num_requests=len(rs),
                share=len(rs) / total,
                hit_rate=hit_rate(rs),
                p50_ttft_ms=_percentile(ttft, 50),
                p99_ttft_ms=_percentile(ttft, 99),
                peak_in_flight=peak_concurrency(rs),
                mean_in_flight=busy_s / span_s if span_s > 0 else 0.0,
                decisions={k: decisions[k] for k in _ordered(decisions)},
            )
        )
    return tuple(out)


def diversion_trend(timeline: Sequence[WindowStats]) -> float | None:
    """Share of ``load`` in the last window minus the first; None if either has no decision."""
    if not timeline or not timeline[0].decision_share or not timeline[-1].decision_share:
        return None
    first = timeline[0].decision_share.get(DIVERSION, 0.0)
    return timeline[-1].decision_share.get(DIVERSION, 0.0) - first


def analyze(
    records: Sequence[RequestRecord], num_windows: int = DEFAULT_WINDOWS
) -> DecisionAnalysis | None:
    """The analysis of one router's records; None when no measured request carries a decision."""
    if num_windows < 1:
        raise ValueError("num_windows must be >= 1")
    runs = measured(records)
    if not any(r.decision for r in runs):
        return None
    timeline = _timeline(runs, num_windows)
    return DecisionAnalysis(
        reasons=_ordered(r.decision for r in runs if r.decision),
        timeline=timeline,
        by_reason=_reason_stats(runs),
        by_backend=_backend_stats(runs),
        diversion_trend=diversion_trend(timeline),
    )


# --- the text tables ----------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100.0 * value:.1f}"


def _num(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _grid(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Rows as aligned text: first column left, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def _mix(decisions: Mapping[str, int], reasons: Sequence[str]) -> str:
    return "/".join(str(decisions.get(reason, 0)) for reason in reasons)


def format_analysis(name: str, analysis: DecisionAnalysis) -> str:
    """Three compact tables: the windows, the reasons, the backends."""
    reasons = analysis.reasons
    trend = analysis.diversion_trend
    trend_text = "n/a" if trend is None else f"{100.0 * trend:+.1f} pp"
    lines = [
        f"{name}: decisions over time; diversion trend "
        f"({DIVERSION} share, last window - first): {trend_text}"
    ]
    rows = [["window (s)", "req", *(f"{r} %" for r in reasons), "hit %", "P50 TTFT ms"]]
    timeline = analysis.timeline
    # whole seconds, unless a window is shorter than 10 s (a short run: "0-0" five times)
    digits = 1 if timeline and min(w.end_s - w.start_s for w in timeline) < 10 else 0
    for w in timeline:
        shares = [_pct(w.decision_share.get(r, 0.0)) if w.decision_share else "-" for r in reasons]
        span = f"{w.start_s:.{digits}f}-{w.end_s:.{digits}f}"
        rows.append([span, str(w.num_requests), *shares, _pct(w.hit_rate), _num(w.p50_ttft_ms)])
    lines += _grid(rows)
    lines.append(f"{name}: what each kind of decision cost")
    rows = [["reason", "req", "share %", "hit %", "predicted %", "left at home pp",
             "recomputed tok", "P50 TTFT ms", "P99 TTFT ms"]]  # fmt: skip
    for reason, s in analysis.by_reason.items():
        rows.append(
            [
                reason,
                str(s.num_requests),
                _pct(s.share),
                _pct(s.hit_rate),
                _pct(s.predicted_hit_rate),
                "n/a" if s.left_hit_rate is None else f"{100.0 * s.left_hit_rate:.2f}",
                _num(s.mean_recomputed_tokens),
                _num(s.p50_ttft_ms),
                _num(s.p99_ttft_ms),
            ]
        )
    lines += _grid(rows)
    lines.append(
        "  (predicted: the hit the router expected; left at home: points of the run's hit\n"
        "  rate predicted on the holders these requests were moved away from)"
    )
    lines.append(f"{name}: per backend (decisions {'/'.join(reasons)})")
    rows = [["backend", "req", "share %", "hit %", "P50 ms", "P99 ms", "in flight", "decisions"]]
    for b in analysis.by_backend:
        rows.append(
            [
                b.backend.removeprefix("http://"),
                str(b.num_requests),
                _pct(b.share),
                _pct(b.hit_rate),
                _num(b.p50_ttft_ms),
                _num(b.p99_ttft_ms),
                f"{b.mean_in_flight:.1f}/{b.peak_in_flight}",
                _mix(b.decisions, reasons),
            ]
        )
    lines += _grid(rows)
    lines.append("  (in flight: mean/peak requests between send and end of stream, client side)")
    return "\n".join(lines)
