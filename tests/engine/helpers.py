"""Builders shared by the engine tests: tiny profiles, requests and a run-to-completion loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.engine import PROFILES, Engine, EngineProfile, TokenOutput
from kvroute.engine.request import Request


def make_profile(**overrides: object) -> EngineProfile:
    """The ``tiny`` profile with fields replaced (keep max_model_len within the cache)."""
    return dataclasses.replace(PROFILES["tiny"], name="test", **overrides)


def make_request(
    request_id: str, token_ids: Sequence[int], block_size: int = 16, max_tokens: int = 1
) -> Request:
    hashes = token_block_hashes(token_ids, block_size, ROOT_SEED)
    return Request(request_id, token_ids, max_tokens, hashes, ROOT_SEED)


def tokens(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start``: prompts sharing a start share a prefix."""
    return list(range(start, start + n))


def run_to_completion(
    engine: Engine, max_steps: int = 100_000
) -> tuple[float, dict[str, list[TokenOutput]]]:
    """Step until idle; returns the engine seconds it took and every request's outputs."""
    outputs: dict[str, list[TokenOutput]] = {}
    elapsed = 0.0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return elapsed, outputs
        result = engine.step()
        elapsed += result.duration_s
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_invariants()
    raise AssertionError(f"engine still busy after {max_steps} steps")
