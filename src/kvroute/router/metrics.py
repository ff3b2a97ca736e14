"""Prometheus metrics of one router app (a registry per app, so tests can build many).

Request-path metrics are plain counters/histograms updated once per request. Per-backend
gauges (in flight, queue, KV usage, circuit, hit rates) are read from the Fleet and the
backend registry only when ``/metrics`` is scraped, so they cost nothing per request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.core.reuse_regime import ReuseRegime

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
DECISION_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
)  # fmt: skip
# observed - predicted TTFT: symmetric, a few tens of ms (jitter) to tens of seconds
TTFT_ERROR_BUCKETS_S = (
    -30.0, -10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class BackendInstruments:
    """Label children of one backend, resolved once."""

    ttft: Any  # Histogram child: kvroute_ttft_seconds{backend}
    e2e: Any  # Histogram child: kvroute_e2e_seconds{backend}
    predicted_cached: Any  # Counter child: kvroute_predicted_cached_tokens_total{backend}
    prompt_tokens: Any  # Counter child: kvroute_routed_prompt_tokens_total{backend}


class RouterMetrics:
    """The request-path instruments; ``registry`` also holds the per-backend collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by HTTP status, backend and routing decision reason",
            ["status", "backend", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Router-side time to first byte of the answer (arrival -> first body chunk sent)",
            ["backend"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_e2e_seconds",
            "Router-side end-to-end latency of proxied requests",
            ["backend"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decision = Histogram(
            "kvroute_decision_seconds",
            "Parse + keys + routing decision time per request",
            buckets=DECISION_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Attempts that failed before the first byte and were retried elsewhere",
            ["backend", "cause"],
            registry=r,
        )
        self.midstream_failures = Counter(
            "kvroute_midstream_failures",
            "Streams cut by a backend failure after the first byte (ended with an SSE error)",
            ["backend"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvroute_client_disconnects",
            "Requests whose client went away before the answer ended (upstream cancelled)",
            registry=r,
        )
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the chosen backend",
            ["backend"],
            registry=r,
        )
        self.left_cached = Counter(
            "kvroute_left_cached_tokens",
            "Prompt tokens the router predicted cached on the holder a request was moved "
            "away from (decisions load and new) and not on its new backend: the hits its "
            "diversions gave up",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_routed_prompt_tokens",
            "Prompt tokens (router estimate) routed to each backend",
            ["backend"],
            registry=r,
        )
        self.session_requests = Counter(
            "kvroute_session_requests",
            "Requests with a session hint, by where they went: home (the backend the "
            "session's last request went to), moved (another one), new (none recorded)",
            ["result"],
            registry=r,
        )
        self._session_children = {
            result: self.session_requests.labels(result) for result in ("home", "moved", "new")
        }
        self.ttft_prediction_error = Histogram(
            "kvroute_ttft_prediction_error_seconds",
            "Observed - predicted TTFT (dispatch to first token) of requests whose decision "
            "carried the cost model's estimate; negative: faster than predicted",
            ["backend"],
            buckets=TTFT_ERROR_BUCKETS_S,
            registry=r,
        )
        # a histogram with negative buckets exports no _sum: the sums are counters, so
        # observed / predicted (the bias) and their difference per request can be read
        self.ttft_predicted = Counter(
            "kvroute_ttft_predicted_seconds",
            "Sum of the estimated TTFTs counted in kvroute_ttft_prediction_error_seconds",
            ["backend"],
            registry=r,
        )
        self.ttft_observed = Counter(
            "kvroute_ttft_observed_seconds",
            "Sum of the observed TTFTs (dispatch to first token) of the same requests",
            ["backend"],
            registry=r,
        )
        self._ttft_children: dict[str, tuple[Any, Any, Any]] = {}

        # label children cached per key: labels() costs a lock and a tuple build per call
        self._request_children: dict[tuple[int, str, str], Any] = {}
        self._backend_children: dict[str, BackendInstruments] = {}

    def count_request(self, status: int, backend: str, reason: str) -> None:
        key = (status, backend, reason)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(str(status), backend, reason)
        child.inc()

    def count_session(self, result: str) -> None:
        """One request with a session hint placed: "home", "moved" or "new"."""
        child = self._session_children.get(result)
        if child is None:
            child = self._session_children[result] = self.session_requests.labels(result)
        child.inc()

    def count_ttft_prediction(self, backend: str, predicted_s: float, observed_s: float) -> None:
        """One first token on ``backend``, ``observed_s`` after dispatch, against the
        ``predicted_s`` its decision estimated."""
        children = self._ttft_children.get(backend)
        if children is None:
            children = self._ttft_children[backend] = (
                self.ttft_prediction_error.labels(backend),
                self.ttft_predicted.labels(backend),
                self.ttft_observed.labels(backend),
            )
        children[0].observe(observed_s - predicted_s)
        children[1].inc(max(0.0, predicted_s))
        children[2].inc(max(0.0, observed_s))

    def of(self, backend: str) -> BackendInstruments:
        """The per-backend instruments (cached; dropped with ``forget``)."""
        inst = self._backend_children.get(backend)
        if inst is None:
            inst = self._backend_children[backend] = BackendInstruments(
                ttft=self.ttft.labels(backend),
                e2e=self.e2e.labels(backend),
                predicted_cached=self.predicted_cached.labels(backend),
                prompt_tokens=self.prompt_tokens.labels(backend),
            )
        return inst

    def forget(self, backend: str) -> None:
        """Drop every series labelled with ``backend`` (it was removed): a fleet whose
        backends come and go (pods) must not grow the exposition without bound."""
        self._backend_children.pop(backend, None)
        self._ttft_children.pop(backend, None)
        for key in [k for k in self._request_children if k[1] == backend]:
            del self._request_children[key]
        for metric in (self.ttft, self.e2e, self.midstream_failures, self.predicted_cached,
                       self.prompt_tokens, self.ttft_prediction_error, self.ttft_predicted,
                       self.ttft_observed):  # fmt: skip
            with contextlib.suppress(KeyError):
                metric.remove(backend)
        for metric, names in ((self.requests, ("status", "backend", "reason")),
                              (self.retries, ("backend", "cause"))):  # fmt: skip
            series = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("backend") == backend
            }
            for values in series:
                metric.remove(*values)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)


class BackendCollector(Collector):
    """Scrape-time gauges from a callable returning one dict of values per backend."""

    # gauge name -> help; each row dict carries these keys (None = unknown, skipped)
    GAUGES: ClassVar[dict[str, str]] = {
        "kvroute_backend_healthy": "1 when the backend is routable (probes ok, circuit not open)",
        "kvroute_backend_draining": "1 while the backend is draining",
        "kvroute_backend_circuit_state": "Circuit breaker: 0 closed, 1 half-open, 2 open",
        "kvroute_backend_in_flight_requests": "Requests the router has in flight on the backend",
        "kvroute_backend_in_flight_tokens": "Tokens (prompt + max new) the router has in flight",
        "kvroute_backend_engine_running": "vllm:num_requests_running, last scrape",
        "kvroute_backend_engine_waiting": "vllm:num_requests_waiting, last scrape",
        "kvroute_backend_engine_kv_usage": "vllm:kv_cache_usage_perc (0..1), last scrape",
        "kvroute_backend_engine_prefix_hits_tokens": "vllm:prefix_cache_hits_total, last scrape",
        "kvroute_backend_engine_prefix_queries_tokens": "vllm:prefix_cache_queries_total",
        "kvroute_backend_predicted_hit_rate": "Router-predicted cached / prompt tokens",
        "kvroute_backend_measured_hit_rate": "Engine-measured prefix hit rate since start",
        "kvroute_backend_index_blocks": "Blocks the router's index holds for the backend",
        "kvroute_backend_hot_blocks": "Blocks the backend's requests reused within its cache's "
        "last turnover (its working set: evicting them costs a recompute)",
        "kvroute_backend_router_in_flight_requests": "Requests this router has in flight there "
        "(its own count; in_flight_requests is merged with the engine's gauges)",
        "kvroute_backend_kv_exact": "1 while the router's view comes from the engine's KV events",
        "kvroute_backend_kv_feed_up": "1 while the KV-event feed task runs (absent: no feed)",
        "kvroute_backend_kv_lag_seconds": "Receive time - engine timestamp of the last KV batch",
        "kvroute_backend_kv_events": "KV events applied from the backend's stream",
        "kvroute_backend_kv_gaps": "Sequence gaps found in the backend's KV event stream",
        "kvroute_backend_kv_restarts": "Engine restarts seen in the backend's KV event stream",
        "kvroute_backend_kv_replays": "KV event replays requested from the backend",
        "kvroute_backend_kv_malformed_batches": "KV batches skipped: failed to decode or apply",
        "kvroute_backend_kv_bad_messages": "KV messages ignored: not framed as [topic, 8-byte "
        "seq, payload]",
        "kvroute_backend_kv_disconnects": "Connections to the KV-event publisher lost (and "
        "made again)",
        "kvroute_backend_kv_feed_restarts": "Times the KV-event feed task failed and restarted",
        "kvroute_backend_kv_overflows": "Times the exact view passed its cap and was dropped",
        "kvroute_backend_kv_skipped_stores": "BlockStored events not keyed: blocks of another "
        "size than the backend's keys, or token ids not one block per hash",
        "kvroute_backend_speculative_blocks": "Dispatched blocks not yet confirmed by KV events",
        "kvroute_backend_reported_hit_rate": "Engine-reported cached_tokens / prompt tokens, "
        "over the responses that reported it",
        "kvroute_backend_reported_predicted_hit_rate": "Router-predicted cached / prompt tokens "
        "over the same responses (compare with reported_hit_rate)",
        "kvroute_backend_prediction_exact_ratio": "Share of reporting responses whose "
        "predicted cached tokens equal the engine's",
    }

    def __init__(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        self._rows = rows

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names are fixed, values come at collect time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self._rows()
        for name, help_text in self.GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["backend"])
            for row in rows:
                value = _gauge_value(row.get(name))
                if value is not None:
                    family.add_metric([row["url"]], value)
            yield family
        total = GaugeMetricFamily("kvroute_index_blocks", "Blocks in the router's prefix index")
        total.add_metric([], float(sum(r.get("kvroute_backend_index_blocks") or 0 for r in rows)))
        yield total


class ProcessCollector(Collector):
    """Router-wide gauges a soak watches for leaks: the event loop's tasks (a leaked
    task per request would grow it) and the proxied requests being handled."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self._in_flight = in_flight

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            tasks: float | None = float(len(asyncio.all_tasks()))
        except RuntimeError:  # collected outside the event loop (a test, a tool)
            tasks = None
        if tasks is not None:
            yield GaugeMetricFamily(
                "kvroute_event_loop_tasks", "Tasks alive on the router's event loop", tasks
            )
        yield GaugeMetricFamily(
            "kvroute_in_flight_requests",
            "Proxied requests being handled now (all backends)",
            float(self._in_flight()),
        )


class SessionCollector(Collector):
    """The sessions whose last backend the router remembers (read at scrape time)."""

    def __init__(self, num_tracked: Callable[[], int]) -> None:
        self._num_tracked = num_tracked

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "kvroute_sessions_tracked",
            "Client sessions with a remembered backend (within the session TTL)",
            float(self._num_tracked()),
        )


class ReuseCollector(Collector):
    """Where the fleet's reuse falls against its caches' residency (core/reuse_regime.py):
    what decides whether new prompts behind a shared head spread or go on cost."""

    def __init__(self, regime: ReuseRegime) -> None:
        self._regime = regime

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r = self._regime
        verdict = {True: 1.0, None: 0.0, False: -1.0}[r.concave]
        yield GaugeMetricFamily(
            "kvroute_reuse_regime",
            "1: reuse crowds just inside the caches' residency (new prompts behind a "
            "shared head spread evenly); -1: just past it; 0: neither clearly (both on cost)",
            verdict,
        )
        yield GaugeMetricFamily(
            "kvroute_reuse_late_requests",
            "Requests whose prefix came back 1/2-1 cache turnover after its last use (decayed)",
            r.late,
        )
        yield GaugeMetricFamily(
            "kvroute_reuse_ghost_requests",
            "Requests whose prefix came back 1-3/2 cache turnovers after its last use (decayed)",
            r.ghost,
        )


def _gauge_value(value: Any) -> float | None:
    """``value`` as a sample, or None (skipped): one odd value (an int beyond a float,
    from an engine or a bug) must not turn the whole /metrics page into a 500."""
    if value is None:
        return None
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        return None
