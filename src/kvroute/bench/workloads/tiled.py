"""N independent copies of a synthetic workload, for fleets N times the size.

A workload sized for 8 replicas (gsp's 64 groups, zipf-hot's 256 prefixes, 30 users)
says little about 1,024: its whole working set fits in a corner of the fleet. Tiling
keeps the shape per replica: copy k is the same workload with its own seed, its prompts
marked so that no block is shared across copies (the first two words recapitalised as
the copy number, ``tile_marked``: lengths and sharing within the copy are kept), its
ids, groups and sessions renamed; the copies' sessions are interleaved one by one, and
the load defaults (users, rates, concurrency cap, request count) are multiplied by N.
``--workload-arg tile=N`` on any synthetic workload (``mooncake`` tiles by arrival time
itself, ``MooncakeParams.tile``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from kvroute.bench.spec import RequestSpec, Session, count_tokens
from kvroute.bench.workloads.base import Workload, WorkloadDefaults
from kvroute.bench.workloads.mooncake import tile_marked


def copy_seed(seed: int, copy: int) -> int:
    """Copy ``copy``'s seed: the workload's own for copy 0, a distinct one for the rest."""
    return seed if copy == 0 else seed * 1_000_003 + copy


def mark_spec(spec: RequestSpec, copy: int) -> RequestSpec:
    """``spec`` as copy ``copy`` (>= 1) of its workload sends it."""
    changes: dict[str, Any] = {
        "request_id": f"{spec.request_id}~{copy}",
        "prefix_group": f"{copy}~{spec.prefix_group}",
        "prompt_token_ids": None,  # the marked words' ids differ
    }
    if spec.session_id is not None:
        changes["session_id"] = f"{copy}~{spec.session_id}"
    if spec.headers:
        changes["headers"] = tuple((name, f"{value}~{copy}") for name, value in spec.headers)
    text = spec.prompt if spec.prompt is not None else spec.messages[0][1] if spec.messages else ""
    marked = tile_marked(text, copy)
    if spec.prompt is not None:
        changes["prompt"] = marked
    elif spec.messages:
        (role, _), *rest = spec.messages
        changes["messages"] = ((role, marked), *rest)
    # the marker's letters may tokenize apart from the punctuation they replace; no token
    # spans the space after the second word, so the difference is in the heads alone
    changes["num_prompt_tokens"] = (
        spec.num_prompt_tokens + _head_tokens(marked) - _head_tokens(text)
    )
    return dataclasses.replace(spec, **changes)


def _head_tokens(text: str) -> int:
    return count_tokens(" ".join(text.split(" ", 2)[:2]))


def _scaled(defaults: WorkloadDefaults, n: int) -> WorkloadDefaults:
    return dataclasses.replace(
        defaults,
        num_users=defaults.num_users * n,
        rates=tuple(r * n for r in defaults.rates),
        max_concurrency=None if defaults.max_concurrency is None else defaults.max_concurrency * n,
        num_requests=None if defaults.num_requests is None else defaults.num_requests * n,
    )


class Tiled(Workload):
    """``copies[k]`` is copy k (its own seed); sessions interleaved one by one."""

    def __init__(self, copies: list[Workload]) -> None:
        first = copies[0]
        super().__init__(first.params, first.seed)
        self.name = first.name  # type: ignore[misc]  # reported as the workload it tiles
        self.defaults = _scaled(first.defaults, len(copies))  # type: ignore[misc]
        self._copies = copies

    def sessions(self) -> Iterator[Session]:
        streams = [iter(c.sessions()) for c in self._copies]
        while True:  # until the first finite copy ends, so every copy keeps its number
            for k, stream in enumerate(streams):
                session = next(stream, None)
                if session is None:
                    return
                yield session if k == 0 else tuple(mark_spec(s, k) for s in session)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tile": len(self._copies)}
