"""Consistent hashing with bounded load: stickiness that yields when a backend is full."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    request_key,
    rest_by_load,
)


@dataclass(frozen=True, slots=True)
class ConsistentHashParams:
    """The consistent-hash policy's knobs (YAML ``policies.consistent_hash``)."""

    SECTION: ClassVar[str] = "consistent_hash"

    epsilon: float = param(0.25, ge=0)  # load bound: (1 + epsilon) x the fleet mean
    # ring points per backend of weight 1 (bounded: the ring is rebuilt on the request path)
    virtual_nodes: int = param(64, ge=1, le=1024)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class HashRing:
    """A consistent-hash ring of backend URLs: ``virtual_nodes`` points per backend of
    weight 1 (scaled by its weight), each at xxh3(``f"{url}#{i}"``), the same in every
    process. It is rebuilt when the candidate list changes, but not for a retry's exclude
    list (a retry skips the excluded backends on the ring it has)."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._source: Sequence[str] = ()  # candidate tuple the ring was built from
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # backend of each position

    def refresh(self, view: FleetView, urls: Sequence[str]) -> None:
        """Rebuild on ``urls`` if they are not the ring's backends (and no retry excludes)."""
        stale = urls is not self._source and urls != self._source
        if not self._points or (stale and not view.excluded):
            entries = []
            for url in urls:
                weight = view.load(url).weight
                for i in range(max(1, round(self.virtual_nodes * weight))):
                    entries.append((xxhash.xxh3_64_intdigest(f"{url}#{i}".encode()), url))
            entries.sort()
            self._points = [p for p, _ in entries]
            self._owners = [u for _, u in entries]
            self._source = urls

    def walk(self, key: int) -> Iterator[str]:
        """The ring's backends clockwise from ``key``, each once (the first is its owner)."""
        n = len(self._points)
        start = bisect_right(self._points, key & 0xFFFF_FFFF_FFFF_FFFF)
        seen: set[str] = set()
        for step in range(n):
            url = self._owners[(start + step) % n]
            if url not in seen:
                seen.add(url)
                yield url


class ConsistentHashPolicy(Policy):
    """Each prefix maps to a point on a hash ring; it goes to the first backend that has room.

    What it does: hashes the request's first block key (so prompts sharing their first
    block land together) onto a ring with ``virtual_nodes`` points per backend (scaled by
    weight) and walks clockwise, skipping backends that are ineligible or whose load
    would exceed ``(1 + epsilon)`` times the fleet mean (in-flight tokens per weight,
    this request included; Mirrokni et al.'s bounded-load rule). Independent routers
    agree without talking. When it loses: the first block is a coarse key (one hot system
    prompt is one point), and it never weighs a deeper cache hit elsewhere against load;
    unbounded variants thrash a saturated engine's cache, which the bound prevents.
    Inputs: load, the eligible list. Knobs (``ConsistentHashParams``): ``epsilon`` (0.25),
    ``virtual_nodes`` (64).
    """

    name = "consistent_hash"
    Params = ConsistentHashParams

    def __init__(self, params: ConsistentHashParams | None = None) -> None:
        params = params or ConsistentHashParams()
        self.epsilon = params.epsilon
        self.virtual_nodes = params.virtual_nodes
        self._ring = HashRing(params.virtual_nodes)

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        candidates = view.candidates()
        if not candidates:
            return None
        self._ring.refresh(view, candidates)
        # Bounded load: a backend takes the request while its load per weight is at most
        # (1 + epsilon) x the fleet mean counted with this request (tokens per weight).
        cost = request.num_prompt_tokens + request.max_tokens
        bound = (1 + self.epsilon) * (view.mean_in_flight_tokens() + cost / len(candidates))
        num_seen = 0
        for url in self._ring.walk(request_key(request)):
            if not view.is_eligible(url):
                continue
            load = view.load(url)
            if load.in_flight_tokens / load.weight <= bound:
                return Decision(url, Reason.HASH, 0, rest_by_load(view, [url]))
            num_seen += 1
            if num_seen >= len(candidates):
                break
        order = view.least_loaded(1)
        url = order[0] if order else candidates[0]
        return Decision(url, Reason.LOAD, 0, rest_by_load(view, [url]))
