"""Cost in seconds: the estimated time to first token of a request on one backend.

    ttft_s = overhead_s
           + queued_prefill_tokens_ahead / rate              (queue wait)
           + max(min_prefill_s, work_tokens / rate)          (this request's prefill)
           + admission_wait_s                                (until KV blocks free up)
           + (evicted_hot_factor * evicted_hot_tokens        (recompute it causes later)
              + evicted_reuse_fraction * other evicted tokens) / rate

    work_tokens = uncached + attention_tokens_per_pair * uncached * (cached + uncached / 2)

The quadratic attention term is expressed in linear-token equivalents so that one learned
rate (tokens/s per backend) calibrates both: with the default 2.5e-5, one new token that
attends to 40k context tokens costs one extra token, which is where the attention and
linear terms of an 8B model on an A100 cross (docs/engine-model.md, constants).

KV pressure is about the blocks this request must take from the engine's free pool: its
uncached tokens and its decode, and the blocks of its hit that no running request pins
(vLLM keeps a freed block's contents cached in the free pool, and a hit on it takes it
back out: ``revived_tokens``). A hit on a prefix that running requests use costs no new
blocks, so a busy holder of a hot prefix is not penalised for being full of that very
prefix; a hit on an idle one is not free (issue 14's multiturn: a conversation whose
context sat idle on a replica full of other conversations was sent back there, priced
as fitting, and waited seconds). When they do not fit, the request waits until enough
running requests end, and memory comes back in lumps, a request at a time: each frees
its output and the blocks of its prompt no other running request shares, and the
request waits until the m-th of them, soonest first, has freed enough. Each is expected
to end a lifetime L after its first token (L learned from the fleet's finishes,
``RequestLifetime``), a queued one a lifetime from now, one already older than L within a
quarter of L; a request the engine runs that we did not send within half of L, freeing
an equal share of what ours do not explain (core/view.py gives these). What the engine
pins is what our requests in flight pin (their distinct blocks, counted fresh) plus the
part of the last scraped usage that requests we did not send explained then: a scrape
is up to an interval old, and the KV of our requests that ended since is free (counting
the whole stale gauge made replicas look full for an interval after a burst ended). (A
wait proportional to the shortage alone, as if memory trickled back, priced a replica
holding three long requests of a 9k-token cache at a tenth of a second when the fourth
would wait seconds: issue 14's gsp runs sent 4-6 requests to such replicas and their P99
TTFT was four times round-robin's.) (An earlier version discounted predicted
hits whenever KV usage was high; on the 40 GB 13B profile, where one long prefix fills a
replica, that sent a third of the traffic away from its cached prefix and thrashed.)

The last term is not this request's time but the time it costs later requests: the
blocks it adds to a full cache evict as many cached blocks. What that costs depends on
which blocks go. Hot ones (``evicted_hot_tokens``: the part of the backend's working set
of reused blocks, core/working_set.py, that no longer fits beside this prompt) are
computed again when their prefix returns, and that recompute delays whoever queues behind
it on the same backend: charged twice (``evicted_hot_factor``), as a diversion's
recompute is (core/policy/prefix.py). That is a floor: while the working set stays over
the capacity, the overflow is recomputed again on every reuse cycle. Of the others
(leftovers never reused, prefixes placed but not yet reused) only a share
(``evicted_reuse_fraction``) would have been hit again. Since engines keep freed blocks
cached, every cache is full in steady state and evicts as many blocks per new one: only
the split tells a cache full of prefixes in use from one full of leftovers. It makes a
cold prompt prefer a replica with free cache, then one whose cache holds leftovers, over
one whose prefixes in use fill it (so the fleet's cache holds the working set, instead
of piling new prefixes onto whichever replica's queue is a few ms shorter and thrashing
it), and keeps overflow of a long prefix from flushing another replica's prefixes
unless the queue it avoids is worth more.

The numbers these terms take are computed here too, from what the router knows of a
backend (core/view.py gathers them): ``kv_free_tokens`` (capacity, less what our
requests and others' pin or have queued), ``evicted_blocks`` (what the new blocks push
out of a full cache) and ``evicted_hot_blocks`` (how many of those are hot).

Token counts enter through ``clamp_count`` (core/load.py), so a client's absurd number
costs a huge but finite time instead of an OverflowError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.load import clamp_count
from kvroute.core.params import ConfigError, check_ranges, param


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Knobs of the TTFT estimate, of the online prefill-rate learner and of the margin a
    diversion away from a prefix's holder must beat (``divert_margin_s``). The router's
    YAML section ``fleet.cost``; each range is declared with its field (core/params.py)."""

    SECTION: ClassVar[str] = "cost"

    prior_prefill_tokens_per_s: float = param(10_000.0, gt=0)  # rate before any observation
    # learned rates are clamped to [min, max]; the prior lies in between
    min_prefill_tokens_per_s: float = param(200.0, gt=0)
    max_prefill_tokens_per_s: float = param(2_000_000.0, gt=0)
    rate_ewma_alpha: float = param(0.2, gt=0, le=1)  # weight of one sample in the log EWMA
    max_sample_ratio: float = param(4.0, ge=1)  # a sample counts as at most this factor off
    # Most a settled rate moves on one sample, in log units (0.005: 0.5 %); the k-th of a
    # run of samples beyond the noise band on the same side may move it k times that.
    rate_step: float = param(0.005, gt=0, le=1)
    rate_noise_band: float = param(1.25, ge=1)  # samples within this factor are noise
    rate_warmup_samples: int = param(5, ge=0)  # the fleet's first samples replace the prior
    min_sample_tokens: int = param(128, ge=0)  # samples with less work are skipped (overhead)
    attention_tokens_per_pair: float = param(2.5e-5, ge=0)  # linear tokens per attention pair
    overhead_s: float = param(0.015, ge=0)  # per-request constant (HTTP, tokenizing, scheduling)
    min_prefill_s: float = param(0.005, ge=0)  # floor of a prefill: one forward pass
    kv_full_wait_s: float = param(1.0, ge=0)  # request lifetime L before one was measured
    lifetime_ewma_alpha: float = param(0.05, gt=0, le=1)  # weight of one finish in L
    evicted_reuse_fraction: float = param(0.2, ge=0)  # share of evicted tokens recomputed later
    # evicted hot tokens (reused recently on that backend) cost this x their prefill time
    evicted_hot_factor: float = param(2.0, ge=0)
    # A request leaves the holder of its prefix only when the other backend's estimate plus
    # ``divert_recompute_share`` x the recompute the move causes there is lower than the
    # holder's by max(divert_margin_s, divert_margin_fraction x holder's estimate)
    # (``diversion_margin_s``), if the holder's hit is at least ``divert_min_cached_share``
    # of the prompt (else the request is mostly new: placed on cost alone, like a cold
    # one). Under pressure the share grows by ``divert_pressure_gain`` x the share of the
    # candidates with a prefill queue, and with no idle candidate a mostly new request is
    # charged too. core/policy/prefix.py says why these defaults.
    divert_margin_s: float = param(0.05, ge=0)
    divert_margin_fraction: float = param(0.2, ge=0, le=1)
    divert_recompute_share: float = param(1.0, ge=0, le=2)
    divert_min_cached_share: float = param(0.5, ge=0, le=1)
    divert_pressure_gain: float = param(1.0, ge=0, le=4)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)
        if not self.min_prefill_tokens_per_s <= self.max_prefill_tokens_per_s:
            raise ConfigError("cost.min_prefill_tokens_per_s", "must be <= the max")
        lo, hi = self.min_prefill_tokens_per_s, self.max_prefill_tokens_per_s
        if not lo <= self.prior_prefill_tokens_per_s <= hi:
            raise ConfigError("cost.prior_prefill_tokens_per_s", "must lie in [min, max]")


def work_tokens(uncached_tokens: int, cached_tokens: int, config: CostConfig) -> float:
    """Prefill work of a request in linear-token equivalents (attention included)."""
    uncached, cached = clamp_count(uncached_tokens), clamp_count(cached_tokens)
    pairs = uncached * (cached + uncached / 2)
    return uncached + config.attention_tokens_per_pair * pairs


def kv_free_tokens(capacity_tokens: float, held_tokens: float, foreign_tokens: float) -> float:
    """KV an engine could give a new request now: its capacity, less what our requests in
    flight pin (``held_tokens``: their distinct prompt blocks, queued ones included, and
    their outputs), less what requests we did not send pin or have queued
    (``foreign_tokens``, from the engine's last scraped gauges: core/view.py)."""
    return capacity_tokens - held_tokens - foreign_tokens


def kv_need_tokens(
    num_prompt_tokens: int, cached_tokens: int, decode_tokens: int, revived_tokens: int
) -> int:
    """KV a request takes from the engine's free pool: its uncached tokens, its decode,
    and the part of its hit no running request pins (``revived_tokens``, at most the hit:
    the engine takes those blocks back out of the pool)."""
    prompt = clamp_count(num_prompt_tokens)
    cached = max(0, min(clamp_count(cached_tokens), prompt - 1))
    revived = min(clamp_count(revived_tokens), cached)
    return prompt - cached + clamp_count(decode_tokens) + revived


def admission_wait_s(
    need_tokens: float, free_tokens: float, releases: Sequence[tuple[float, float]]
) -> float:
    """How long a request needing ``need_tokens`` of KV waits for running requests to end
    and free theirs; ``releases``: (when one is expected to end, the KV its end frees),
    soonest first (module docstring). If all of them ending is not enough, the last."""
    if need_tokens <= free_tokens or not releases:
        return 0.0
    free = free_tokens
    for when_s, tokens in releases:
        free += tokens
        if free >= need_tokens:
            return when_s
    return releases[-1][0]


class RequestLifetime:
    """Mean time from a request's first token to its end (an EWMA over the fleet's
    successful finishes): how long a running request keeps its KV blocks."""

    __slots__ = ("alpha", "mean_s")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.mean_s: float | None = None  # None until a request finished

    def observe(self, seconds: float) -> None:
        if not 0 <= seconds < math.inf:
            return
        mean = self.mean_s
        self.mean_s = seconds if mean is None else mean + self.alpha * (seconds - mean)


def evicted_blocks(held_blocks: int, capacity_blocks: int, new_blocks: int) -> int:
    """Cached blocks pushed out when ``new_blocks`` join a cache of ``capacity_blocks``
    that holds ``held_blocks``: as many as it overflows by, at most all it holds."""
    return min(held_blocks, max(0, held_blocks + new_blocks - capacity_blocks))


def evicted_hot_blocks(
    evicted: int, hot_blocks: int, joining_blocks: int, capacity_blocks: int
) -> int:
    """Of ``evicted`` blocks, those of the backend's working set (``hot_blocks`` of it
    held, ``joining_blocks`` of the new prompt joining it): hot ones go only when the
    working set, the prompt in it, no longer fits the cache."""
    return min(evicted, max(0, hot_blocks + joining_blocks - capacity_blocks))


def estimate_ttft_s(
    *,
    num_prompt_tokens: int,
    cached_tokens: int,
    queued_prefill_tokens: int,
    prefill_tokens_per_s: float,
    config: CostConfig,
    kv_free_tokens: float = float("inf"),
    decode_tokens: int = 0,
    revived_tokens: int = 0,
    evicted_tokens: float = 0.0,
    evicted_hot_tokens: float = 0.0,
    kv_releases: Sequence[tuple[float, float]] = (),
) -> float:
    """Estimated TTFT in seconds of a request on one backend (module docstring).

    ``kv_free_tokens``: KV the engine could give this request now (``kv_free_tokens()``);
    ``decode_tokens``: the KV its output will add; ``revived_tokens``: the part of its hit
    that no running request pins (the engine takes those blocks back out of its free
    pool); ``evicted_tokens``: cached tokens its new blocks push out, of which
    ``evicted_hot_tokens`` (at most all) belong to the backend's working set;
    ``kv_releases``: when the requests running there are expected to end and what each
    frees, soonest first (``admission_wait_s``; without them a request that does not fit
    waits ``kv_full_wait_s``).
    """
    num_prompt_tokens = clamp_count(num_prompt_tokens)
    cached = max(0, min(clamp_count(cached_tokens), num_prompt_tokens - 1))
    uncached = max(0, num_prompt_tokens - cached)
    decode_tokens = clamp_count(decode_tokens)
    queue_wait_s = clamp_count(queued_prefill_tokens) / prefill_tokens_per_s
    prefill_s = max(
        config.min_prefill_s, work_tokens(uncached, cached, config) / prefill_tokens_per_s
    )
    eviction_s = eviction_cost_s(evicted_tokens, evicted_hot_tokens, prefill_tokens_per_s, config)
    need = kv_need_tokens(num_prompt_tokens, cached, decode_tokens, revived_tokens)
    if need <= kv_free_tokens:
        wait_s = 0.0
    elif kv_releases:
        wait_s = admission_wait_s(need, kv_free_tokens, kv_releases)
    else:
        wait_s = config.kv_full_wait_s
    return config.overhead_s + queue_wait_s + prefill_s + wait_s + eviction_s


def eviction_cost_s(
    evicted_tokens: float,
    evicted_hot_tokens: float,
    prefill_tokens_per_s: float,
    config: CostConfig,
) -> float:
    """The part of ``estimate_ttft_s`` that evictions add: the recompute they cause
    later, hot tokens (at most all evicted) weighted more. ``estimate_ttft_s`` adds it
    last, so an estimate with evictions is exactly the one without plus this."""
    evicted_tokens = clamp_count(evicted_tokens)
    evicted_hot_tokens = min(clamp_count(evicted_hot_tokens), evicted_tokens)
    recomputed = config.evicted_hot_factor * evicted_hot_tokens + config.evicted_reuse_fraction * (
        evicted_tokens - evicted_hot_tokens
    )
    return recomputed / prefill_tokens_per_s


def diversion_margin_s(holder_ttft_s: float, config: CostConfig) -> float:
    """How much lower than the holder's estimate a diversion's charged estimate must be.

    The absolute part covers a few tens of ms of jitter in any estimate; the relative part
    the error of the learned rate, which scales every term that divides by it.
    """
    return max(config.divert_margin_s, config.divert_margin_fraction * holder_ttft_s)


class PrefillRate:
    """A prefill rate (tokens/s), learned online from observed TTFTs, robust to outliers.

    Each first token gives one sample: (work queued ahead at dispatch + this request's
    work) / (TTFT - overhead). Since the queue ahead is counted the way ``estimate_ttft_s``
    counts it, the learned rate is the one that makes the estimate right on average.

    Two kinds share this class. The fleet's rate (no ``reference``) starts at the
    configured prior; its first ``rate_warmup_samples`` samples replace the prior (their
    running mean in log space, each clipped to ``max_sample_ratio`` of the mean so far),
    since a guess from a config file is worth less than a measurement. A backend's rate
    (``reference`` = the fleet's, ``scale`` = its weight) is the fleet's rate x weight x a
    learned offset that starts at 1: a backend departs from its peers only as far as its
    own samples insist, so a few slow first tokens (a warm-up, a pause) cannot make it
    look slow, while a level change that every backend sees (longer prompts, a busier
    fleet) moves all of them at once.

    Once settled, a sample moves the estimate by its log-space EWMA step
    (``rate_ewma_alpha`` x the log ratio, the ratio clipped to ``max_sample_ratio``), but
    by at most ``rate_step`` (0.5 %); a run of k samples beyond ``rate_noise_band`` on the
    same side may move it by k x ``rate_step`` on its k-th. So a burst of 5 outliers (a
    GC pause, a preemption: several in-flight requests at once) moves a settled rate by at
    most (1 + ... + 5) x 0.5 % = 7.5 % (a little more when a run was already under way),
    one outlier by 0.5 %, while a sustained 2x change is followed within ~30 samples and a
    4x one within ~45, accelerating as long as the samples keep disagreeing.
    """

    __slots__ = (
        "_log_offset",
        "_memo",
        "_reference",
        "_run",
        "_scale",
        "config",
        "num_samples",
        "version",
    )

    def __init__(
        self, config: CostConfig, reference: PrefillRate | None = None, scale: float = 1.0
    ) -> None:
        self.config = config
        self._reference = reference
        self._scale = scale
        # log of the rate itself (fleet), or of the offset from reference x scale (backend)
        self._log_offset = (
            0.0
            if reference is not None
            else math.log(self._clamp(config.prior_prefill_tokens_per_s))
        )
        self._run = 0  # signed length of the current run of samples beyond the noise band
        self.num_samples = 0
        self.version = 0  # moves whenever the estimate may have
        self._memo = (-1, -1, 0.0)  # (version, the reference's, tokens_per_s then)

    def _clamp(self, tokens_per_s: float) -> float:
        cfg = self.config
        return min(max(tokens_per_s, cfg.min_prefill_tokens_per_s), cfg.max_prefill_tokens_per_s)

    def _log_base(self) -> float:
        ref = self._reference
        return 0.0 if ref is None else math.log(ref.tokens_per_s * self._scale)

    @property
    def tokens_per_s(self) -> float:
        """The estimate, within [min, max] (recomputed only after a sample moved it)."""
        ref = self._reference
        ref_version = -1 if ref is None else ref.version
        version, memo_ref_version, value = self._memo
        if version == self.version and memo_ref_version == ref_version:
            return value
        value = self._clamp(math.exp(self._log_base() + self._log_offset))
        self._memo = (self.version, ref_version, value)
        return value

    def observe(self, work: float, ttft_s: float) -> None:
        """Learn from one request: ``work`` tokens (ahead + own) took ``ttft_s``."""
        cfg = self.config
        service_s = ttft_s - cfg.overhead_s
        if work < cfg.min_sample_tokens or service_s <= 0:
            return
        ref = self._reference
        if ref is not None and ref.num_samples < cfg.rate_warmup_samples:
            self.num_samples += 1  # the fleet's level is leaving its prior: no offset yet
            return
        log_base = self._log_base()
        clip = math.log(cfg.max_sample_ratio)
        current = math.log(self._clamp(math.exp(log_base + self._log_offset)))
        residual = min(max(math.log(work / service_s) - current, -clip), clip)
        if ref is None and self.num_samples < cfg.rate_warmup_samples:
            step = residual / (self.num_samples + 1)
        else:
            step = self._bounded_step(residual)
        # keep the offset where the clamped rate can still follow it back
        lo = math.log(cfg.min_prefill_tokens_per_s) - log_base
        hi = math.log(cfg.max_prefill_tokens_per_s) - log_base
        self._log_offset = min(max(self._log_offset + step, lo), hi)
        self.num_samples += 1
        self.version += 1

    def _bounded_step(self, residual: float) -> float:
        """The EWMA step of ``residual``, within +-rate_step x the run it extends."""
        cfg = self.config
        sign = 1 if residual > 0 else -1
        if self._run * sign < 0:
            self._run = 0
        if abs(residual) > math.log(cfg.rate_noise_band):
            self._run += sign
        bound = cfg.rate_step * max(1, abs(self._run))
        return min(max(cfg.rate_ewma_alpha * residual, -bound), bound)
