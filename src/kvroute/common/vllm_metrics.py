"""vLLM's ``/metrics`` page: the few series kvroute reads, under every name vLLM used
(and the load gauges of SGLang, llama.cpp and TGI under theirs).

One parser for the router's scraper (load and cache size of each backend) and for the
benchmarks (engine-measured hit rate, block size). Pure: text in, numbers out.

Names, as vLLM exports them (Prometheus appends ``_total`` to a counter's samples):

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: gauges, requests.
- ``vllm:kv_cache_usage_perc``: gauge, 0..1. Older releases called it
  ``vllm:gpu_cache_usage_perc``; for a while both were exported with the same value.
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: counters in
  tokens (queries += prompt tokens, hits += cached tokens, per request). Before 0.9.2
  they were ``vllm:gpu_prefix_cache_queries_total`` / ``..._hits_total``, then both
  names were exported side by side until the old ones were hidden. Only one name is read
  per page, the newest it has, so a page with both is not counted twice.
- ``vllm:prompt_tokens_total``, ``vllm:num_preemptions_total``: counters.
- ``vllm:cache_config_info``: an info gauge (value 1) whose labels carry the cache
  configuration; ``block_size`` (tokens per KV block) and ``num_gpu_blocks`` (blocks in
  the cache) size the router's cache models.

A data-parallel or multi-model server exports one series per engine and model (labels
``engine``, ``model_name``); the series of a name are summed. A sample whose value is
negative, NaN or infinite is no state and is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# each quantity's sample names, newest first: the first one a page has is read. The
# load gauges of other engines follow vLLM's: SGLang (--enable-metrics), llama.cpp's
# llama-server (--metrics; no KV usage gauge) and TGI, each exporting only its own
RUNNING = (
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
    "tgi_batch_current_size",
)
WAITING = (
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
    "tgi_queue_size",
)
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
# SGLang's counters of every prompt token and of the cached ones (summed over its
# cache_source label: device, host, storage) are its queries and hits
PREFIX_CACHE_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
    "sglang:prompt_tokens_total",
)
PREFIX_CACHE_HITS = (
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
    "sglang:cached_tokens_total",
)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
CACHE_CONFIG_INFO = "vllm:cache_config_info"

_NAMES = (
    *RUNNING,
    *WAITING,
    *KV_CACHE_USAGE,
    *PREFIX_CACHE_QUERIES,
    *PREFIX_CACHE_HITS,
    *PROMPT_TOKENS,
    *PREEMPTIONS,
)
# family names as they appear in # HELP / # TYPE lines (a counter's without _total)
_PREFIXES = tuple(dict.fromkeys(n.removesuffix("_total") for n in (*_NAMES, CACHE_CONFIG_INFO)))


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one ``/metrics`` page says (None: the page does not export it)."""

    num_running: int | None  # requests in the running batch
    num_waiting: int | None  # requests in the waiting queue
    kv_cache_usage: float | None  # used KV blocks / all blocks, 0..1
    prefix_cache_queries: float | None  # cumulative, tokens
    prefix_cache_hits: float | None  # cumulative, tokens
    prompt_tokens: float | None  # cumulative prompt tokens
    num_preemptions: float | None  # cumulative preempted requests
    block_size: int | None  # tokens per KV block (cache_config_info)
    num_gpu_blocks: int | None  # KV blocks of the cache (cache_config_info)


def _wanted(line: str) -> bool:
    if line.startswith(("# HELP ", "# TYPE ")):
        line = line[7:]
    return line.startswith(_PREFIXES)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """The EngineMetrics of one page. ValueError when a kept line is not Prometheus text."""
    # a vLLM page has hundreds of histogram lines: keep only the families read
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    block_size = num_gpu_blocks = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG_INFO:
                block_size = _int_label(sample.labels, "block_size") or block_size
                num_gpu_blocks = _int_label(sample.labels, "num_gpu_blocks") or num_gpu_blocks
            elif sample.name in _NAMES and math.isfinite(sample.value) and sample.value >= 0:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    return EngineMetrics(
        num_running=_opt_int(first(RUNNING)),
        num_waiting=_opt_int(first(WAITING)),
        kv_cache_usage=first(KV_CACHE_USAGE),
        prefix_cache_queries=first(PREFIX_CACHE_QUERIES),
        prefix_cache_hits=first(PREFIX_CACHE_HITS),
        prompt_tokens=first(PROMPT_TOKENS),
        num_preemptions=first(PREEMPTIONS),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
    )


def _opt_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    """A positive integer label (vLLM writes them as "16" or "16.0"; "None" when unset)."""
    raw = labels.get(name)
    try:
        value = float(raw) if raw not in (None, "", "None") else math.nan
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value > 0 else None
