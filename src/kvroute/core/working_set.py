"""A backend's hot working set: the blocks its requests reuse, timed by its cache's turnover.

Why: new blocks on a full cache push out as many cached ones, and what that costs later
depends on which blocks go (core/cost.py). Engines keep freed blocks cached until they
need the room, so in steady state every cache is full and every backend evicts one
block per new block: a count of evictions cannot tell a cache full of prefixes in use
from one full of one-off leftovers. Reuse can. A backend whose reused blocks plus a new
prompt fit in its cache loses only leftovers to it; one whose reused blocks already fill
it loses blocks that its next requests will compute again.

Time is counted in blocks the backend had to add (its requests' uncached blocks), not in
seconds: once an LRU cache of C blocks has added C blocks, every block not touched since
is gone. So reuse within about C additions (``window``) is a working set the cache can
keep, and reuse after much longer would have missed anyway. No time constant, and the
window scales with the cache.

Reuse is demand, not hits: a block counts as reused when a request routed to the backend
touches it again while its entry is kept, whether or not the cache still held the block
(the entry outlives it, as ARC's ghost entries do). A backend whose working set does not
fit thrashes, evicting its blocks before their reuse; counting hits alone would make it
look emptier than it is and send it more.

Aging by generations, so that a request whose blocks are already hot costs two binary
searches, not a write per block: touched blocks go to the current generation; once the
backend has added ``window`` blocks since it began, it becomes the previous one and the
previous one is dropped. An entry is kept one to two windows after its last touch.

Along one chain, the blocks with an entry, the blocks in the current generation, and the
reused ones each form a prefix (touching a block touches all its ancestors in the same
call, and entries only leave a generation all at once), so a request's overlap with
each is one binary search (``num_hot_leading``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat


class WorkingSet:
    """Blocks one backend's requests touched lately, and which of them were reused.

    Invariants (``check_invariants``): a key is in at most one generation; a value is 1
    when the block was touched again while it had an entry (reused), else 0; ``num_hot``
    counts the reused entries of both generations.
    """

    __slots__ = ("_current", "_hot_current", "_hot_previous", "_previous", "_until")

    def __init__(self) -> None:
        self._current: dict[int, int] = {}  # key -> reused (0/1), touched this generation
        self._previous: dict[int, int] = {}  # the same, last generation
        self._hot_current = 0  # reused entries in _current
        self._hot_previous = 0  # reused entries in _previous
        self._until = 0  # additions left before the current generation turns previous

    @property
    def num_hot(self) -> int:
        """Blocks touched at least twice, the last time within one to two windows."""
        return self._hot_current + self._hot_previous

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def touch(self, keys: Sequence[int], num_added: int, window: int, max_entries: int) -> None:
        """A request routed here used ``keys`` (root first), of which the backend had to
        add ``num_added``; a generation lasts ``window`` additions, or until it holds half
        of ``max_entries``. Binary searches, then loops in C over the blocks that change
        generation."""
        current, previous = self._current, self._previous
        keys = keys[: max(1, window)]  # the cache keeps the head of a prompt it cannot hold
        in_current = _leading(keys, 0, lambda k: k in current)
        reused_in_current = _leading(keys, 0, lambda k: current.get(k) == 1, in_current)
        kept = _leading(keys, in_current, lambda k: k in previous)
        # touched again: reused now (those of the previous generation move up)
        current.update(zip(keys[reused_in_current:in_current], repeat(1)))
        moved = keys[in_current:kept]
        self._hot_previous -= sum(map(previous.pop, moved))
        current.update(zip(moved, repeat(1)))
        current.update(zip(keys[kept:], repeat(0)))
        self._hot_current += kept - reused_in_current
        self._until -= max(0, num_added)
        if self._until <= 0 or 2 * len(current) >= max_entries:
            self._previous, self._hot_previous = current, self._hot_current
            self._current, self._hot_current = {}, 0
            self._until = window

    def num_hot_leading(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` in the working set (reused, entry kept)."""
        current, previous = self._current, self._previous
        return _leading(keys, 0, lambda k: (current.get(k) or previous.get(k)) == 1)

    def clear(self) -> None:
        self._current, self._previous = {}, {}
        self._hot_current = self._hot_previous = 0

    def check_invariants(self) -> None:
        assert not self._current.keys() & self._previous.keys(), "working set: key in both"
        assert sum(self._current.values()) == self._hot_current, "working set: current count"
        assert sum(self._previous.values()) == self._hot_previous, "working set: previous"


def _leading(keys: Sequence[int], lo: int, test: Callable[[int], bool], hi: int = -1) -> int:
    """End of the run of ``keys[lo:hi]`` that pass ``test`` (a prefix of it must pass)."""
    hi = len(keys) if hi < 0 else hi
    while lo < hi:
        mid = (lo + hi) // 2
        if test(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
