"""Session affinity: which backend a client session's last request went to.

Why: agent harnesses and chat front-ends send a session identity (a header, or the
body's ``user``). A session's next turn repeats its whole context, which is cached where
its last turn ran; the prefix index says the same while the cache model still holds the
context, but forgets it once the model evicts it, and a session's context is exactly
what a full fleet evicts between two turns of a slow human. The table keeps the answer
"where did this session go last" for ``ttl_s`` after its last request, whatever the
index says; the policy decides whether going home is still worth it.

Bounded twice: entries not seen for ``ttl_s`` are gone (``get`` no longer answers for
them; ``put`` and ``expire`` drop them), and at most ``max_entries`` are kept, the least
recently seen going first. Time is an argument; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict

DEFAULT_TTL_S = 600.0  # a session idle this long has no home any more
DEFAULT_MAX_ENTRIES = 100_000  # ~35 MB at ~350 B an entry (key, node, reverse index)


def session_key(model: str | None, session: str) -> str:
    """The table's key of ``session`` on ``model``: one id on two models is two sessions
    (each model's backends hold its own context). The model's length first, so no pair of
    strings can make another pair's key ("-" starts the keys of requests naming no model)."""
    return f"-{session}" if model is None else f"{len(model)}:{model}{session}"


def session_result(recorded: str | None, chosen: str) -> str:
    """How a request with a session hint was placed: "new" (no recorded backend),
    "home" (its recorded backend) or "moved" (another one), for metrics."""
    if recorded is None:
        return "new"
    return "home" if recorded == chosen else "moved"


class SessionTable:
    """Session key -> (backend URL of its last dispatch, last seen), LRU and TTL bounded.

    Invariants (``check_invariants``): entries are in last-seen order, oldest first, with
    non-decreasing seen times (a ``put`` with a ``now`` earlier than the latest counts as
    seen at the latest: a worker's mirrored dispatch may arrive late, and the sorted order
    is what lets expiry pop from the front); ``url_to_keys`` lists each key under its
    entry's URL and nowhere else; at most ``max_entries`` entries. Every operation is
    amortised O(1) (``forget_backend``: O(the backend's sessions)).
    """

    __slots__ = ("_entries", "_latest", "max_entries", "ttl_s", "url_to_keys")

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if not ttl_s > 0:  # nan fails too
            raise ValueError(f"sessions.ttl_s: must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"sessions.max_entries: must be >= 1, got {max_entries}")
        self.ttl_s = float(ttl_s)
        self.max_entries = int(max_entries)
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (url, seen)
        self._latest = -math.inf  # the latest seen time given to put
        self.url_to_keys: dict[str, set[str]] = {}  # reverse index, for forget_backend

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included (``expire`` first)."""
        return len(self._entries)

    def get(self, key: str, now: float) -> str | None:
        """The backend ``key``'s last request went to, unless not seen for ``ttl_s``.

        A pure read: it neither refreshes the entry (only a dispatch does) nor drops it.
        """
        entry = self._entries.get(key)
        if entry is None or now - entry[1] >= self.ttl_s:
            return None
        return entry[0]

    def put(self, key: str, url: str, now: float) -> None:
        """``key``'s request was dispatched to ``url`` at ``now``: it is its home now."""
        self.expire(now)
        self._latest = seen = max(self._latest, now)
        old = self._entries.pop(key, None)
        if old is not None and old[0] != url:
            self._unlist(key, old[0])
        self._entries[key] = (url, seen)
        if old is None or old[0] != url:
            self.url_to_keys.setdefault(url, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._pop_oldest()

    def expire(self, now: float) -> int:
        """Drop the entries not seen for ``ttl_s`` at ``now``; how many went."""
        entries, ttl_s = self._entries, self.ttl_s
        num = 0
        while entries:
            _, (_, seen) = next(iter(entries.items()))
            if now - seen < ttl_s:
                break
            self._pop_oldest()
            num += 1
        return num

    def forget_backend(self, url: str) -> int:
        """Drop every session whose home is ``url`` (it left the fleet); how many went."""
        keys = self.url_to_keys.pop(url, set())
        for key in keys:
            del self._entries[key]
        return len(keys)

    def _pop_oldest(self) -> None:
        key, (url, _) = self._entries.popitem(last=False)
        self._unlist(key, url)

    def _unlist(self, key: str, url: str) -> None:
        keys = self.url_to_keys[url]
        keys.discard(key)
        if not keys:
            del self.url_to_keys[url]

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_entries, "sessions: over max_entries"
        last = -math.inf
        listed: dict[str, set[str]] = {}
        for key, (url, seen) in self._entries.items():
            assert seen >= last, "sessions: entries out of last-seen order"
            assert seen <= self._latest, "sessions: seen after the latest put"
            last = seen
            listed.setdefault(url, set()).add(key)
        assert listed == self.url_to_keys, "sessions: reverse index differs from entries"
