"""``/metrics`` of one simulated backend, with vLLM's metric names and labels.

Each backend has its own ``CollectorRegistry`` (several backends live in one process).
Engine state (queue gauges, KV usage, prefix-cache counters, preemptions) is read from
``Engine.stats`` at scrape time, so the request path pays nothing for it; per-request
figures (TTFT, latency, token counts, finished requests) are recorded by
``record_finished`` once per request. Latencies are wall-clock seconds as the server saw
them (with ``--speedup X`` they are X times shorter than the modelled ones).

Labels follow vLLM V1: ``model_name`` and ``engine="0"`` on every series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.engine.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector(Collector):
    """Gauges and engine counters read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], labels: tuple[str, str]) -> None:
        self._stats = stats
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        lv = self._labels
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_cache_usage),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, float(value))
            yield g
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
             "queried tokens.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
             "tokens.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, float(value))
            yield c
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
                "prefix_caching_hash_algo", "engine",
            ],
        )  # fmt: skip
        info.add_metric([str(s.block_size), str(s.num_gpu_blocks), "0", "True", "sim", "0"], 1.0)
        yield info


class SimMetrics:
    """The Prometheus registry of one backend and its per-request recorders."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = (model_name, "0")
        self.registry.register(_EngineCollector(stats, labels))
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*labels)

        self.ttft_s = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        )  # fmt: skip
        self.e2e_s = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.itl_s = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS_S,
        )  # fmt: skip
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.output_len = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABELS, "finished_reason"], registry=r,
        )  # fmt: skip
        self._success_by_reason = {
            reason: self._success.labels(*labels, reason) for reason in ("stop", "length", "abort")
        }

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft_s.observe(ttft_s)

    def record_finished(
        self, *, e2e_s: float, ttft_s: float | None, num_prompt: int, num_output: int, reason: str
    ) -> None:
        """One finished (or aborted, ``reason="abort"``) request."""
        self._success_by_reason[reason].inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.prompt_len.observe(num_prompt)
        self.output_len.observe(num_output)
        self.e2e_s.observe(e2e_s)
        if ttft_s is not None and num_output > 1:
            self.itl_s.observe((e2e_s - ttft_s) / (num_output - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
