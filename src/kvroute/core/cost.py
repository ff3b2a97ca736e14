"""Cost in seconds: the estimated time to first token of a request on one backend.

    ttft_s = overhead_s
           + queued_prefill_tokens_ahead / rate              (queue wait)
           + max(min_prefill_s, work_tokens / rate)          (this request's prefill)
           + kv_pressure_s                                   (admission wait near full KV)

    work_tokens = uncached + attention_tokens_per_pair * uncached * (cached + uncached / 2)

The quadratic attention term is expressed in linear-token equivalents so that one learned
rate (tokens/s per backend) calibrates both: with the default 2.5e-5, one new token that
attends to 40k context tokens costs one extra token, which is where the attention and
linear terms of an 8B model on an A100 cross (anchors/workloads-and-cost-model.md §3.5).
Near-full KV makes predicted cached blocks less trustworthy (they may be evicted before
the request is admitted) and may hold admission until running requests free blocks; both
effects grow smoothly above ``kv_pressure_threshold``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


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
    kv_pressure_threshold: float = 0.85  # KV usage above which pressure terms start, [0, 1)
    kv_full_wait_s: float = 1.0  # admission wait estimated at 100 % KV usage
    kv_full_cached_loss: float = 0.5  # fraction of predicted hit assumed evicted at 100 %

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
        if not self.kv_pressure_threshold < 1:
            raise ValueError("cost.kv_pressure_threshold: must be in [0, 1)")
        if self.kv_full_cached_loss > 1:
            raise ValueError("cost.kv_full_cached_loss: must be in [0, 1]")


def work_tokens(uncached_tokens: int, cached_tokens: int, config: CostConfig) -> float:
    """Prefill work of a request in linear-token equivalents (attention included)."""
    pairs = uncached_tokens * (cached_tokens + uncached_tokens / 2)
    return uncached_tokens + config.attention_tokens_per_pair * pairs


def kv_pressure(kv_usage: float, config: CostConfig) -> float:
    """0 below the threshold, rising quadratically to 1 at full KV usage."""
    thr = config.kv_pressure_threshold
    if kv_usage <= thr:
        return 0.0
    x = min(1.0, (kv_usage - thr) / (1.0 - thr))
    return x * x


def estimate_ttft_s(
    *,
    num_prompt_tokens: int,
    cached_tokens: int,
    queued_prefill_tokens: int,
    prefill_tokens_per_s: float,
    kv_usage: float,
    config: CostConfig,
) -> float:
    """Estimated TTFT in seconds of a request on one backend (module docstring)."""
    pressure = kv_pressure(kv_usage, config)
    cached = int(cached_tokens * (1.0 - config.kv_full_cached_loss * pressure))
    cached = max(0, min(cached, num_prompt_tokens - 1))
    uncached = max(0, num_prompt_tokens - cached)
    queue_wait_s = queued_prefill_tokens / prefill_tokens_per_s
    prefill_s = max(
        config.min_prefill_s, work_tokens(uncached, cached, config) / prefill_tokens_per_s
    )
    return config.overhead_s + queue_wait_s + prefill_s + config.kv_full_wait_s * pressure


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
