"""Bytes of prompt text per engine token, learned per model from the engines' usage.

Approximate mode knows a prompt only as text: it cuts keys of ``block_size * 4`` bytes
and estimates ``bytes / 4`` tokens (``keys.CHARS_PER_TOKEN``), the built-in tokenizer's
ratio. Real tokenizers give about 3 to 4.5 bytes per token on English text (less on
code and non-Latin scripts), so a prompt's token count, a key block's tokens and an
engine's capacity in key blocks are off by that factor. Every engine answer reports
``usage.prompt_tokens``; with the UTF-8 length of the text the router keyed, each is one
observation of the ratio.

The estimate of a model is the median of its last ``WINDOW`` observations, each clamped
to [MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN]. A median, not a mean: a minority of odd
requests (a prompt that is mostly chat template, a base64 blob, a tokenizer's worst
case) cannot move it, whatever their values (a breakdown point of one half), and over a
bounded window it follows a change of traffic or tokenizer within ``WINDOW / 2``
requests. Prompts under ``MIN_SAMPLE_TOKENS`` are not observed: a chat template's fixed
overhead dominates their ratio.

What the router uses (``bytes_per_token``) moves only when the median leaves a band of
``HYSTERESIS`` around the value in use, so the capacities and costs built on it do not
flicker with every request; a model uses its own estimate once it has ``MIN_SAMPLES``
observations, the pooled one (every model's observations) before, and the prior before
that. At most ``max_models`` models are tracked (the least recently observed is
forgotten); names reach here only once a backend lists them.

The estimate scales the router's text keys, which are never recut: a key block of
``block_size * 4`` bytes stands for ``key_block_tokens`` tokens, and an engine cache of
N blocks holds ``key_capacity_blocks`` key blocks.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque

from kvroute.core.keys import CHARS_PER_TOKEN

MIN_BYTES_PER_TOKEN = 1.0  # one token per byte: byte-level fallback on any text
MAX_BYTES_PER_TOKEN = 16.0  # far above any tokenizer's mean on real text
WINDOW = 64  # observations per model the median is taken over
MIN_SAMPLES = 4  # observations before an estimate replaces its fallback
MIN_SAMPLE_TOKENS = 32  # shorter prompts are mostly chat template: not observed
HYSTERESIS = 0.03  # the value in use moves when the median is 3 % away from it
MAX_MODELS = 256  # models tracked at once


class RatioEstimate:
    """One model's bytes per token: a running median and the value in use."""

    __slots__ = ("_recent", "_sorted", "applied", "num_samples")

    def __init__(self) -> None:
        self._recent: deque[float] = deque()  # the window, oldest first
        self._sorted: list[float] = []  # the same values, sorted
        self.applied: float | None = None  # None until MIN_SAMPLES observations
        self.num_samples = 0

    @property
    def median(self) -> float | None:
        s = self._sorted
        if not s:
            return None
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2

    def observe(self, ratio: float) -> bool:
        """Add one observation (clamped); True when the value in use changed."""
        ratio = min(max(ratio, MIN_BYTES_PER_TOKEN), MAX_BYTES_PER_TOKEN)
        if len(self._recent) >= WINDOW:
            old = self._recent.popleft()
            del self._sorted[_index(self._sorted, old)]
        self._recent.append(ratio)
        insort(self._sorted, ratio)
        self.num_samples += 1
        median = self.median
        assert median is not None, "calibration: median of a non-empty window"
        if self.num_samples < MIN_SAMPLES:
            return False
        if self.applied is not None and abs(median / self.applied - 1) <= HYSTERESIS:
            return False
        self.applied = median
        return True


def _index(values: list[float], value: float) -> int:
    """Position of ``value`` in the sorted ``values`` (it is there)."""
    i = bisect_left(values, value)
    assert values[i] == value, "calibration: window and sorted copy disagree"
    return i


class TextCalibration:
    """Bytes per token per model (and pooled over all), learned from engine usage."""

    def __init__(self, prior: float = CHARS_PER_TOKEN, max_models: int = MAX_MODELS) -> None:
        if not MIN_BYTES_PER_TOKEN <= prior <= MAX_BYTES_PER_TOKEN:
            raise ValueError(f"prior bytes per token must be in [1, 16], got {prior}")
        if max_models < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models}")
        self.prior = float(prior)
        self.max_models = max_models
        self.pooled = RatioEstimate()
        self.model_to_estimate: OrderedDict[str, RatioEstimate] = OrderedDict()

    def observe(self, model: str | None, text_bytes: int, prompt_tokens: int) -> bool:
        """One answer: ``prompt_tokens`` (its usage) for a prompt keyed from ``text_bytes``
        bytes of text. ``model`` None: pooled only. True when a value in use changed."""
        if not _is_count(text_bytes) or not _is_count(prompt_tokens):
            return False
        if prompt_tokens < MIN_SAMPLE_TOKENS or text_bytes < 1:
            return False
        ratio = text_bytes / prompt_tokens
        if not math.isfinite(ratio):
            return False
        changed = self.pooled.observe(ratio)
        if model is not None:
            changed |= self._estimate(model).observe(ratio)
        return changed

    def _estimate(self, model: str) -> RatioEstimate:
        estimates = self.model_to_estimate
        estimate = estimates.get(model)
        if estimate is None:
            if len(estimates) >= self.max_models:
                estimates.popitem(last=False)  # the least recently observed
            estimate = estimates[model] = RatioEstimate()
        else:
            estimates.move_to_end(model)
        return estimate

    def bytes_per_token(self, model: str | None) -> float:
        """The value in use for ``model``: its own, else the pooled one, else the prior."""
        learned = self._learned(model)
        return learned if learned is not None else self.prior

    def is_learned(self, model: str | None) -> bool:
        """Whether ``model``'s ratio comes from answers (its own or the pooled one), not
        the prior: until then a token estimate may be off by a quarter either way."""
        return self._learned(model) is not None

    def _learned(self, model: str | None) -> float | None:
        """``model``'s own value in use, else the pooled one, else None."""
        if model is not None:
            estimate = self.model_to_estimate.get(model)
            if estimate is not None and estimate.applied is not None:
                return estimate.applied
        return self.pooled.applied

    def estimate_tokens(self, model: str | None, text_bytes: int) -> int:
        """Tokens of a prompt of ``text_bytes`` UTF-8 bytes (at least 1)."""
        return max(1, int(text_bytes / self.bytes_per_token(model)))

    def mean_bytes_per_token(self, models: frozenset[str]) -> float:
        """Bytes per token of the text a backend listing ``models`` caches: the mean over
        them (one, usually), the pooled value for a backend whose models are unknown."""
        if not models:
            return self.bytes_per_token(None)
        return sum(self.bytes_per_token(m) for m in models) / len(models)


def key_block_tokens(block_size: int, bytes_per_token: float) -> int:
    """Tokens a text key block (``block_size * 4`` bytes) stands for at ``bytes_per_token``."""
    if bytes_per_token == CHARS_PER_TOKEN:
        return block_size
    return max(1, round(block_size * CHARS_PER_TOKEN / bytes_per_token))


def key_capacity_blocks(engine_blocks: int, bytes_per_token: float) -> int:
    """An engine cache of ``engine_blocks`` blocks in text key blocks: each engine block
    holds ``bytes_per_token / 4`` of them."""
    scale = bytes_per_token / CHARS_PER_TOKEN
    return engine_blocks if scale == 1 else max(1, round(engine_blocks * scale))


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0
