"""Builders for the exact-mode tests: an 'engine' whose hashes use another seed."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import BlockStored
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import RouteRequest, make_policy

BS = 4  # tokens per block in these stories
ENGINE_SEED = 0xDEAD_BEEF  # the engine's own chain root: unlike the router's


def tokens(*segments: tuple[int, int]) -> list[int]:
    """A prompt made of (token value, number of blocks) segments."""
    out: list[int] = []
    for value, blocks in segments:
        out += [value] * (blocks * BS)
    return out


def router_keys(ids: Sequence[int]) -> list[int]:
    return token_block_hashes(ids, BS)


def engine_hashes(ids: Sequence[int]) -> list[int]:
    return token_block_hashes(ids, BS, ENGINE_SEED) if ids else []


def stored(ids: Sequence[int], start_block: int = 0, end_block: int | None = None) -> BlockStored:
    """The BlockStored an engine emits for blocks [start, end) of prompt ``ids``."""
    hashes = engine_hashes(ids)
    end = len(hashes) if end_block is None else end_block
    parent = hashes[start_block - 1] if start_block else None
    return BlockStored(hashes[start_block:end], parent, list(ids[start_block * BS : end * BS]), BS)


def exact_fleet(
    n: int = 2, *, mode: str = "exact", ttl: float = 3.0, policy: str = "prefix", **policy_kw
):
    config = FleetConfig(
        default_block_size=BS, default_capacity_blocks=1000, mode=mode, speculative_ttl_s=ttl
    )
    fleet = Fleet(make_policy(policy, **policy_kw), config)
    for i in range(n):
        fleet.add_backend(url(i))
    return fleet


def url(i: int) -> str:
    return f"http://e{i}:8000"


def request(rid: str, ids: Sequence[int], max_tokens: int = 8) -> RouteRequest:
    return RouteRequest(rid, None, router_keys(ids), len(ids) + 1, max_tokens)


def sync(fleet: Fleet, u: str, now: float = 0.0) -> None:
    """Make ``u`` exact: its engine's first (empty) batch arrives."""
    fleet.apply_kv_batch(u, 0, 1.0, [], now)
    assert fleet.is_exact(u)


def matched(fleet: Fleet, u: str, ids: Sequence[int]) -> int:
    return fleet.index.matched_blocks(u, router_keys(ids))
