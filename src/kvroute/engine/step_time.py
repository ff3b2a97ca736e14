"""How long one engine step takes (docs/engine-model.md, "Step time").

    step = t_fwd0 + b * P + c * pairs + k_ctx * ctx + per_seq * B   (per_seq = 4.4e-3 ms)

P: prefill tokens of the step; pairs: sum over prefill chunks of n * (m + n / 2) for a
chunk of n tokens after m already in the KV (attention work); ctx: context tokens of the
decoding sequences (KV read); B: sequences in the step. ``a_api`` is not part of a step:
the caller adds it to each request's TTFT.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvroute.engine.profiles import EngineProfile


@dataclass(frozen=True, slots=True)
class StepWork:
    """The work of one step, in the units the cost terms take."""

    num_prefill_tokens: int  # P
    attention_pairs: float  # sum of n * (m + n / 2) over prefill chunks
    decode_ctx_tokens: int  # ctx: KV tokens read by decoding sequences
    num_seqs: int  # B


class StepTimeModel:
    """Step duration from a profile; optional seeded jitter of +-``jitter`` on every term."""

    def __init__(
        self, profile: EngineProfile, *, jitter: float = 0.0, rng: random.Random | None = None
    ) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
        self._terms_ms = (
            profile.t_fwd0_ms,
            profile.b_ms_per_token,
            profile.c_ms_per_pair,
            profile.k_ctx_ms_per_token,
            profile.per_seq_ms,
        )
        self._jitter = jitter
        self._rng = rng if rng is not None else random.Random(0)

    @property
    def jitter(self) -> float:
        """The +- fraction each term is jittered by (0.0: deterministic step times)."""
        return self._jitter

    def duration_s(self, work: StepWork) -> float:
        """Modelled seconds of one step doing ``work`` (0.0 for an empty step)."""
        if work.num_seqs == 0:
            return 0.0
        t0, b, c, k, s = self._terms_ms
        terms = (
            t0,
            b * work.num_prefill_tokens,
            c * work.attention_pairs,
            k * work.decode_ctx_tokens,
            s * work.num_seqs,
        )
        if self._jitter:
            j, uniform = self._jitter, self._rng.uniform
            return sum(t * (1.0 + uniform(-j, j)) for t in terms) / 1000.0
        # added left to right, as decode_durations_s adds them
        return (terms[0] + terms[1] + terms[2] + terms[3] + terms[4]) / 1000.0

    def decode_durations_s(self, ctx_tokens: int, num_seqs: int, num_steps: int) -> list[float]:
        """``duration_s`` of ``num_steps`` decode-only steps of ``num_seqs`` (>= 1)
        sequences, the first reading ``ctx_tokens`` of context and each next one
        ``num_seqs`` more: the same sums, without a ``StepWork`` per step. No jitter."""
        if self._jitter or num_seqs < 1:
            raise ValueError("decode_durations_s: deterministic steps of >= 1 sequence only")
        t0, b, c, k, s = self._terms_ms
        head = t0 + b * 0 + c * 0.0  # no prefill tokens, no attention pairs
        seqs = s * num_seqs
        return [(head + k * (ctx_tokens + j * num_seqs) + seqs) / 1000.0 for j in range(num_steps)]
