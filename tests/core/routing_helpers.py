"""Small builders shared by the routing-core tests (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.common.hashing import token_block_hashes
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import RouteRequest, make_policy

BS = 16  # block size of every test fleet


def chain(*segments: tuple[int, int]) -> list[int]:
    """Block keys of a prompt made of (token value, number of blocks) segments."""
    tokens: list[int] = []
    for value, blocks in segments:
        tokens += [value] * (blocks * BS)
    return token_block_hashes(tokens, BS)


def req(
    request_id: str,
    blocks: Sequence[int],
    *,
    prompt_tokens: int | None = None,
    model: str | None = None,
    max_tokens: int = 16,
) -> RouteRequest:
    tokens = prompt_tokens if prompt_tokens is not None else len(blocks) * BS + 5
    return RouteRequest(request_id, model, list(blocks), tokens, max_tokens)


def make_fleet(policy: str = "prefix", n: int = 4, *, capacity: int = 1000, **kw: object) -> Fleet:
    config = FleetConfig(default_block_size=BS, default_capacity_blocks=capacity)
    fleet = Fleet(make_policy(policy, **kw), config)  # type: ignore[arg-type]
    for i in range(n):
        fleet.add_backend(url(i))
    return fleet


def url(i: int) -> str:
    return f"http://b{i}:8000"


def serve(fleet: Fleet, request: RouteRequest, now: float = 0.0, *, exclude: Sequence[str] = ()):
    """Route and dispatch one request; returns (decision, ticket)."""
    decision = fleet.route(request, now, exclude=exclude)
    assert decision is not None
    ticket = fleet.dispatch(decision, request, now)
    fleet.check_invariants()
    return decision, ticket
