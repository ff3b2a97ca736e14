"""The load order: which backends of a model are least loaded, without scanning the fleet.

Policies ask on every request for the k backends with the fewest in-flight tokens per
unit of weight among those serving the request's model (``FleetView.least_loaded``, and
``match`` when a prefix has many holders). A scan would make each decision O(fleet);
instead the order is kept sorted, per model group, and core/fleet.py moves a backend in
it whenever the backend's load changes.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator


class GroupKey:
    """A group or cache key no model name can equal (a client picks names: any string)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


ALL = GroupKey("all")  # load-order group of every orderable backend
WILD = GroupKey("wild")  # group of backends whose model list is unknown (serve any model)
Group = str | GroupKey  # a model name or one of the keys above
OrderKey = tuple[float, int, str]  # (in-flight tokens / weight, tiebreak, url)


def groups_of(models: frozenset[str]) -> tuple[Group, ...]:
    """The groups a backend listing ``models`` is ordered in (none listed: any model)."""
    return (ALL, *sorted(models)) if models else (ALL, WILD)


class LoadOrder:
    """Healthy, non-draining backends sorted by weighted in-flight tokens, per model group.

    A backend appears once in each of its groups (every model it serves, or the wildcard
    group when its models are unknown, plus the all-backends group). Reordering on a load
    change is a bisect and a list insert per group: no per-request scan of the fleet.
    Ties go by the backend's ``tiebreak`` (a hash of its URL), then its URL.
    """

    def __init__(self) -> None:
        self.group_to_keys: dict[Group, list[OrderKey]] = {}
        self.url_to_entry: dict[str, tuple[OrderKey, tuple[Group, ...], int, float]] = {}
        self.total_tokens = 0  # over entries
        self.total_weight = 0.0

    def __len__(self) -> int:
        return len(self.url_to_entry)

    def put(
        self, url: str, models: frozenset[str], tokens: int, weight: float, tiebreak: int
    ) -> None:
        """Place ``url`` (again) with ``tokens`` in flight."""
        key = (tokens / weight, tiebreak, url)
        groups = groups_of(models)
        if self.url_to_entry.get(url) == (key, groups, tokens, weight):
            return  # already there (a scrape that moved no count): nothing to move
        self.discard(url)
        for g in groups:
            insort(self.group_to_keys.setdefault(g, []), key)
        self.url_to_entry[url] = (key, groups, tokens, weight)
        self.total_tokens += tokens
        self.total_weight += weight

    def discard(self, url: str) -> None:
        entry = self.url_to_entry.pop(url, None)
        if entry is None:
            return
        key, groups, tokens, weight = entry
        for g in groups:
            keys = self.group_to_keys[g]
            i = bisect_left(keys, key)
            assert keys[i] == key, "load order: entry missing from its group"
            del keys[i]
            if not keys:
                del self.group_to_keys[g]
        self.total_tokens -= tokens
        self.total_weight -= weight

    def urls(self, model: str | None) -> Iterator[str]:
        """Least loaded first, among backends serving ``model`` (None: all)."""
        if model is None:
            keys: Iterable[OrderKey] = self.group_to_keys.get(ALL, ())
        else:
            named = self.group_to_keys.get(model, [])
            wild = self.group_to_keys.get(WILD, [])
            keys = heapq.merge(named, wild) if named and wild else (named or wild)
        for key in keys:
            yield key[2]

    def key_of(self, url: str) -> OrderKey:
        return self.url_to_entry[url][0]

    def mean_tokens(self) -> float:
        """Mean in-flight tokens per unit of weight over the ordered backends."""
        return self.total_tokens / self.total_weight if self.total_weight > 0 else 0.0
