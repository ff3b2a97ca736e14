"""Engine profiles: the hardware/model constants of the step-time and cache model.

A profile is data: the built-in table (docs/engine-model.md) or a user's YAML file with
the same field names, e.g. constants fitted from their own vLLM (read by
``sim/profiles.py``: this package does no I/O). Every field is range checked when the
profile is built, so a bad YAML file fails at load, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvroute.common.yaml_text import number_as_text_hint


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine (model x GPU setup) as the simulator sees it; times in milliseconds."""

    name: str  # profile name, as selected by --profile
    block_size: int  # tokens per KV block (16 on GPUs)
    kv_capacity_tokens: int  # KV cache size; num_gpu_blocks = this // block_size
    t_fwd0_ms: float  # fixed cost of one forward step (weights read, launch)
    b_ms_per_token: float  # cost per prefill token (linear layers)
    c_ms_per_pair: float  # cost per attention pair of a prefill chunk
    k_ctx_ms_per_token: float  # cost per context token read by a decoding sequence
    a_api_ms: float  # per-request API overhead added to TTFT by the caller, not by step()
    max_num_seqs: int = 256  # most sequences in one step (vLLM --max-num-seqs)
    max_num_batched_tokens: int = 8192  # token budget of one step (chunked prefill)
    max_model_len: int = 32768  # longest prompt + output a request may have
    per_seq_ms: float = 4.4e-3  # sampling and bookkeeping per sequence in a step
    gpus: int = 1  # GPUs one replica occupies (its tensor-parallel degree): what it costs

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("profile field 'name' must be a non-empty string")
        for field in ("block_size", "kv_capacity_tokens", "max_num_seqs", "gpus"):
            _check_int(field, getattr(self, field), 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        for field in ("t_fwd0_ms", "b_ms_per_token", "c_ms_per_pair", "k_ctx_ms_per_token"):
            _check_float(field, getattr(self, field))
        _check_float("a_api_ms", self.a_api_ms)
        _check_float("per_seq_ms", self.per_seq_ms)
        if self.num_gpu_blocks < 1:
            raise ValueError("profile field 'kv_capacity_tokens' must hold at least one block")
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            # vLLM refuses to start when one max-length request cannot fit in the cache;
            # this also guarantees that a lone running request never needs preempting.
            raise ValueError(
                f"profile field 'max_model_len' ({self.max_model_len}) exceeds the KV "
                f"cache ({self.num_gpu_blocks * self.block_size} tokens)"
            )

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks of the cache, as vLLM reports in cache_config_info."""
        return self.kv_capacity_tokens // self.block_size


def _check_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"profile field {field!r} must be an integer >= {minimum}, got {value!r}")


def _check_float(field: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"profile field {field!r} must be a finite number >= 0, got {value!r}"
            + number_as_text_hint(value)
        )


def _row(
    name: str, kv: int, t0: float, b: float, c: float, k: float, a: float, **kw: Any
) -> EngineProfile:
    return EngineProfile(name, 16, kv, t0, b, c, k, a, **kw)


PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        _row("llama-3.1-8b-a100", 440_000, 12, 0.090, 3.4e-6, 1.26e-4, 15),
        _row("codellama-13b-a100", 58_000, 19, 0.160, 5.3e-6, 7.9e-4, 15, max_model_len=16384),
        _row("codellama-13b-a100-40g", 9_000, 19, 0.160, 5.3e-6, 7.9e-4, 15, max_model_len=8192),
        _row("llama-3.1-70b-a100-tp4", 470_000, 26, 0.250, 4.2e-6, 7.9e-5, 15, gpus=4),
        _row("llama-3.1-8b-h100", 440_000, 8, 0.028, 1.1e-6, 7.7e-5, 15),
        _row("codellama-13b-h100", 58_000, 13, 0.050, 1.7e-6, 4.9e-4, 15, max_model_len=16384),
        _row("llama-3.1-70b-h100-tp4", 470_000, 17, 0.074, 1.3e-6, 4.8e-5, 15, gpus=4),
        _row("tiny", 8_192, 1, 0.010, 0, 0, 1, max_model_len=8192),
        # Router-overhead runs: every step is free, so only the proxy's cost shows.
        _row("instant", 1_000_000, 0, 0, 0, 0, 0, max_num_seqs=4096,
             max_num_batched_tokens=1_048_576, per_seq_ms=0.0),
    )
}  # fmt: skip
