"""How fast each backend's prefix cache turns over: recent tokens added per token it holds.

Why it steers new prefixes: a full LRU cache keeps a block for as long as it takes the
backend to add a cache's worth of new ones. A prompt no backend holds (a cold one) is
computed wherever it goes and becomes a block set that evicts others there; where it goes
decides whose residency it shortens. Placing cold prompts where the queue is momentarily
shortest, or where the eviction estimate is momentarily lowest, piles them onto a few
backends in bursts: those caches churn faster than the rest, their prefixes die before
their next use, and the fleet holds less of its working set than its size allows.
Spreading the additions so that every cache turns over at the same rate (in proportion
to its size) gives every prefix the same, longest possible residency. The prefix policy
places a cold prompt that fits nowhere without evicting on the candidate with the lowest
turnover, among those within the diversion margin of the fastest and, if any, those
where it evicts no reused blocks (core/policy/prefix.py). Where a cache has room, no
block dies and the cost alone decides.

Measured in cache turnovers, decayed: each dispatch adds its uncached tokens / the
backend's capacity in tokens, and every value decays by e^-1 per mean turnover of the
fleet (a clock that advances by the same amount / the number of backends). So the
measure looks back about one turnover of the caches, whatever their size or the traffic,
and a backend that joins starts at 0 and takes new prefixes until it has caught up (its
queue still bounds how many, through the margin). Pure: no clock reads.
"""

from __future__ import annotations

import math


class CacheTurnover:
    """Decayed turnover (cache turnovers, about the last one) per backend URL."""

    __slots__ = ("_clock", "_url_to")

    def __init__(self) -> None:
        self._clock = 0.0  # mean turnovers of the fleet's caches so far
        self._url_to: dict[str, tuple[float, float]] = {}  # url -> (value, clock then)

    def add(self, url: str, tokens: int, capacity_tokens: int, num_backends: int) -> None:
        """``url`` added ``tokens`` to a cache of ``capacity_tokens``, in a fleet of
        ``num_backends``."""
        if tokens <= 0 or capacity_tokens <= 0:
            return
        turns = min(1.0, tokens / capacity_tokens)  # a prompt past the cache: one turnover
        self._clock += turns / max(1, num_backends)
        self._url_to[url] = (self.of(url) + turns, self._clock)

    def of(self, url: str) -> float:
        """``url``'s turnover now (0 for a backend that added nothing lately)."""
        entry = self._url_to.get(url)
        if entry is None:
            return 0.0
        value, then = entry
        return value * math.exp(then - self._clock)

    def forget(self, url: str) -> None:
        self._url_to.pop(url, None)
