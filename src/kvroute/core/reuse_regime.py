"""Where the fleet's reuse falls against how long its caches keep a block.

Why: a prefix cache keeps a block for about one turnover (the time in which the cache
adds as many new blocks as it holds), and a request hits if its prefix was last used
within that time. Call the share of reuses at distance at most t F(t): the fleet's hit
rate follows F at the residency its caches give. Where a new prompt goes decides whose
residency it shortens. Spreading new prompts so that every cache turns over at the same
rate gives every block the same residency, the best choice where F is concave there
(most reuse comes a little before eviction: more reuse lies just inside the residency than
just past it, and unequal residencies lose more on the short side than they win on the
long). Where F is convex (the reuse lies mostly past the residency, as when a working set
is many times the fleet's KV), unequal residency wins: placing new prompts by cost piles
them on a few caches that churn, and the others keep their blocks long enough to reach
reuse that equal residencies would all miss (Jensen's inequality either way).

So the test is the density of reuse distances on each side of the residency C: reuses
at distance in [C/2, C) ("late": hit, barely) against those in [C, 3C/2) ("ghost":
missed, barely; ARC's ghost entries measure the same thing). ``concave`` is True when the
late ones outnumber the ghosts by more than the noise, False when the ghosts do, and
None when neither does (F about linear there: where new prompts go changes no hit, so
the cost alone should decide) or too little was seen. A side wins when it has half as
much again as the other (``MIN_LEAD``: a lead of a fifth of both; the hits that even or
uneven residency gain grow with that difference, and below it a placement for hits would
give up the cost rule's latency for little; on the public Mooncake trace the whole run
on 8 replicas shows 2x, the small-cache slice of it within 10 %) and when that lead is
past the noise: ``Z`` / sqrt(requests that saw either). Both are counted in requests,
not blocks: the sampled blocks of one request mostly share one distance (the last use of
its prefix), so a request is one vote, split between the sides as its sampled blocks
are, and a few long prompts cannot decide alone.

Measured fleet-wide, in fleet additions (new blocks dispatched, every backend's) against
the fleet's capacity in blocks, on a spatial sample: every ``stride``-th block of a
prompt, which is the same block in every prompt that holds it (keys chain from the root),
so its last use is known without keeping every block. The stride keeps about
``SAMPLES_PER_TURNOVER`` sampled blocks per turnover. Counts decay by e^-1 every
``MEMORY_TURNOVERS`` turnovers, so the verdict follows a change of traffic. Entries live
in two generations of 3C/2 additions each, so every reuse up to 3C/2 is seen and memory
stays bounded by what the fleet adds in 3C. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SAMPLES_PER_TURNOVER = 4096  # sampled blocks per turnover of the fleet's caches
MEMORY_TURNOVERS = 4.0  # counts decay by e^-1 over this many turnovers
MIN_VOTES = 16.0  # decayed requests that saw a late or ghost reuse, before a verdict
Z = 2.0  # standard errors a side must lead by
MIN_LEAD = 0.2  # ... and its lead as a share of both: 1.5 times the other side


class ReuseRegime:
    """The fleet's reuse-distance density around its caches' residency (module doc)."""

    __slots__ = (
        "_capacity",
        "_clock",
        "_current",
        "_gen_end",
        "_previous",
        "ghost",
        "late",
        "stride",
    )

    def __init__(self) -> None:
        self._capacity = 0  # the fleet's cache in blocks, as of the last observation
        self.stride = 1
        self._clock = 0  # fleet additions so far, in blocks
        self._current: dict[int, int] = {}  # sampled key -> clock at its last use
        self._previous: dict[int, int] = {}
        self._gen_end = 0
        self.late = 0.0  # decayed votes of requests reused at distance in [C/2, C)
        self.ghost = 0.0  # ... in [C, 3C/2)

    @property
    def concave(self) -> bool | None:
        """True: reuse crowds just inside the residency (spread new prompts evenly);
        False: just past it (uneven residency wins); None: neither clearly (module doc)."""
        votes = self.late + self.ghost
        if votes < MIN_VOTES:
            return None
        lead = (self.late - self.ghost) / votes
        if abs(lead) < MIN_LEAD or abs(lead) * math.sqrt(votes) < Z:
            return None
        return lead > 0

    def observe(self, keys: Sequence[int], num_added: int, capacity_blocks: int) -> None:
        """A dispatch used ``keys`` (root first) and added ``num_added`` new blocks to a
        fleet whose caches hold ``capacity_blocks`` in all."""
        if capacity_blocks <= 0:
            return
        if capacity_blocks != self._capacity:
            self._resize(capacity_blocks)
        cap = self._capacity
        now = self._clock
        current, previous = self._current, self._previous
        late = ghost = 0
        lo, mid, hi = cap // 2, cap, cap + cap // 2
        for key in keys[self.stride - 1 :: self.stride]:
            then = current.get(key)
            if then is None:
                then = previous.pop(key, None)
            if then is not None:
                d = now - then
                if lo <= d < mid:
                    late += 1
                elif mid <= d < hi:
                    ghost += 1
            current[key] = now
        added = max(0, num_added)
        if added:
            decay = math.exp(-added / (MEMORY_TURNOVERS * cap))
            self.late *= decay
            self.ghost *= decay
            self._clock = now + added
        if late or ghost:  # one vote, split as its sampled blocks are
            self.late += late / (late + ghost)
            self.ghost += ghost / (late + ghost)
        if self._clock >= self._gen_end:
            self._previous, self._current = current, {}
            self._gen_end = self._clock + hi

    def _resize(self, capacity_blocks: int) -> None:
        """A new fleet capacity: a new stride, and what was sampled with the old one goes."""
        self._capacity = capacity_blocks
        stride = max(1, capacity_blocks // SAMPLES_PER_TURNOVER)
        if stride != self.stride:
            self.stride = stride
            self._current, self._previous = {}, {}
        self._gen_end = self._clock + capacity_blocks + capacity_blocks // 2
