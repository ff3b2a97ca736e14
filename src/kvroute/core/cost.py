"""Cost in seconds: the estimated time to first token of a request on one backend.

    ttft_s = overhead_s
           + queued_prefill_tokens_ahead / rate              (queue wait)
           + max(min_prefill_s, work_tokens / rate)          (this request's prefill)
           + kv_full_wait_s * kv_shortage                    (admission wait for KV blocks)
           + evicted_reuse_fraction * evicted_tokens / rate  (recompute it causes later)

    work_tokens = uncached + attention_tokens_per_pair * uncached * (cached + uncached / 2)

The quadratic attention term is expressed in linear-token equivalents so that one learned
rate (tokens/s per backend) calibrates both: with the default 2.5e-5, one new token that
attends to 40k context tokens costs one extra token, which is where the attention and
linear terms of an 8B model on an A100 cross (anchors/workloads-and-cost-model.md §3.5).

KV pressure is about the blocks this request must *add*: the engine admits it only when
its uncached tokens (and its decode) fit in the blocks not pinned by running requests
and not claimed by prefills queued ahead. A cached prefix costs no new blocks, and while
requests using it run its blocks are pinned, so a busy holder of a hot prefix is not
penalised for being full of that very prefix. (An earlier version discounted predicted
hits whenever KV usage was high; on the 40 GB 13B profile, where one long prefix fills a
replica, that sent a third of the traffic away from its cached prefix and thrashed.)

The last term is not this request's time but the time it costs later requests: the
blocks it adds to a full cache evict as many cached blocks, and a share of those
(``evicted_reuse_fraction``) would have been hit again. It makes a cold prompt prefer a
replica with free cache over a full one holding other prefixes (so the fleet's total
cache is used, instead of piling new prefixes onto whichever replica shares a first
block), and keeps overflow of a long prefix from flushing another replica's prefix
unless the queue it avoids is worth more.

Token counts enter through ``clamp_count`` (core/load.py), so a client's absurd number
costs a huge but finite time instead of an OverflowError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvroute.core.load import clamp_count


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Knobs of the TTFT estimate and of the online prefill-rate learner."""

    prior_prefill_tokens_per_s: float = 10_000.0  # rate before any observation
    min_prefill_tokens_per_s: float = 200.0  # learned rate is clamped to [min, max]
    max_prefill_tokens_per_s: float = 2_000_000.0
    rate_ewma_alpha: float = 0.2  # weight of one sample in the log-space EWMA, (0, 1]
    max_sample_ratio: float = 4.0  # one sample moves the rate by at most this factor
    min_sample_tokens: int = 128  # samples with less work are dominated by overhead: skipped
    attention_tokens_per_pair: float = 2.5e-5  # linear-token equivalent of one attention pair
    overhead_s: float = 0.015  # per-request constant (HTTP, tokenization, scheduling)
    min_prefill_s: float = 0.005  # floor of a prefill: one forward pass, even on a full hit
    kv_full_wait_s: float = 1.0  # admission wait when a whole cache's worth of KV is missing
    evicted_reuse_fraction: float = 0.2  # share of evicted cached tokens recomputed later

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) >= 0:
                raise ValueError(f"cost.{f.name}: must be >= 0, got {getattr(self, f.name)}")
        if not 0 < self.min_prefill_tokens_per_s <= self.max_prefill_tokens_per_s:
            raise ValueError("cost.min_prefill_tokens_per_s: must be in (0, max]")
        lo, hi = self.min_prefill_tokens_per_s, self.max_prefill_tokens_per_s
        if not lo <= self.prior_prefill_tokens_per_s <= hi:
            raise ValueError("cost.prior_prefill_tokens_per_s: must lie in [min, max]")
        if not 0 < self.rate_ewma_alpha <= 1:
            raise ValueError("cost.rate_ewma_alpha: must be in (0, 1]")
        if self.max_sample_ratio < 1:
            raise ValueError("cost.max_sample_ratio: must be >= 1")


def work_tokens(uncached_tokens: int, cached_tokens: int, config: CostConfig) -> float:
    """Prefill work of a request in linear-token equivalents (attention included)."""
    uncached, cached = clamp_count(uncached_tokens), clamp_count(cached_tokens)
    pairs = uncached * (cached + uncached / 2)
    return uncached + config.attention_tokens_per_pair * pairs


def kv_shortage(need_tokens: float, free_tokens: float, capacity_tokens: float) -> float:
    """Share of the cache (0..1) that a request's new KV lacks; 0 when it fits now."""
    if capacity_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, need_tokens - free_tokens) / capacity_tokens)


def estimate_ttft_s(
    *,
    num_prompt_tokens: int,
    cached_tokens: int,
    queued_prefill_tokens: int,
    prefill_tokens_per_s: float,
    config: CostConfig,
    kv_free_tokens: float = float("inf"),
    kv_capacity_tokens: float = 0.0,
    decode_tokens: int = 0,
    evicted_tokens: float = 0.0,
) -> float:
    """Estimated TTFT in seconds of a request on one backend (module docstring).

    ``kv_free_tokens``: KV the engine could give this request now (capacity minus blocks
    pinned by running requests minus prefills queued ahead); ``decode_tokens``: the KV its
    output will add; ``evicted_tokens``: cached tokens its new blocks push out.
    """
    num_prompt_tokens = clamp_count(num_prompt_tokens)
    cached = max(0, min(clamp_count(cached_tokens), num_prompt_tokens - 1))
    uncached = max(0, num_prompt_tokens - cached)
    decode_tokens = clamp_count(decode_tokens)
    evicted_tokens = clamp_count(evicted_tokens)
    queue_wait_s = clamp_count(queued_prefill_tokens) / prefill_tokens_per_s
    prefill_s = max(
        config.min_prefill_s, work_tokens(uncached, cached, config) / prefill_tokens_per_s
    )
    shortage = kv_shortage(uncached + decode_tokens, kv_free_tokens, kv_capacity_tokens)
    eviction_s = config.evicted_reuse_fraction * evicted_tokens / prefill_tokens_per_s
    wait_s = config.kv_full_wait_s * shortage
    return config.overhead_s + queue_wait_s + prefill_s + wait_s + eviction_s


class PrefillRate:
    """A backend's prefill rate (tokens/s), learned online from observed TTFTs.

    Each first token gives one sample: (work queued ahead at dispatch + this request's
    work) / (TTFT - overhead). The estimate is an EWMA in log space (a ratio error counts
    the same up or down), each sample clipped to ``max_sample_ratio`` of the current value
    and the result to [min, max], so a stalled or instant response cannot swing it far.
    Since the queue ahead is counted the way ``estimate_ttft_s`` counts it, the learned
    rate is the one that makes the estimate right on average.
    """

    __slots__ = ("config", "num_samples", "tokens_per_s")

    def __init__(self, config: CostConfig) -> None:
        self.config = config
        self.tokens_per_s = config.prior_prefill_tokens_per_s
        self.num_samples = 0

    def observe(self, work: float, ttft_s: float) -> None:
        """Learn from one request: ``work`` tokens (ahead + own) took ``ttft_s``."""
        cfg = self.config
        service_s = ttft_s - cfg.overhead_s
        if work < cfg.min_sample_tokens or service_s <= 0:
            return
        ratio = cfg.max_sample_ratio
        sample = min(max(work / service_s, self.tokens_per_s / ratio), self.tokens_per_s * ratio)
        a = cfg.rate_ewma_alpha
        log_rate = (1 - a) * math.log(self.tokens_per_s) + a * math.log(sample)
        rate = math.exp(log_rate)
        self.tokens_per_s = min(
            max(rate, cfg.min_prefill_tokens_per_s), cfg.max_prefill_tokens_per_s
        )
        self.num_samples += 1
