"""The session table: session key -> backend, bounded in entries and in time."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute.core.sessions import SessionTable, session_result


def test_a_session_remembers_its_last_backend_until_its_ttl() -> None:
    table = SessionTable(ttl_s=10.0, max_entries=4)
    assert table.get("s1", 0.0) is None
    table.put("s1", "http://a", 0.0)
    table.put("s1", "http://b", 5.0)  # the last dispatch wins, and refreshes
    assert table.get("s1", 14.9) == "http://b"
    assert table.get("s1", 15.0) is None  # not seen for ttl_s: gone
    assert len(table) == 1  # a read never changes the table
    assert table.expire(15.0) == 1
    assert len(table) == 0
    table.check_invariants()


def test_the_least_recently_seen_session_goes_first_when_full() -> None:
    table = SessionTable(ttl_s=100.0, max_entries=2)
    table.put("s1", "http://a", 0.0)
    table.put("s2", "http://a", 1.0)
    table.put("s1", "http://b", 2.0)  # s1 seen again: s2 is now the oldest
    table.put("s3", "http://c", 3.0)
    assert [table.get(k, 3.0) for k in ("s1", "s2", "s3")] == ["http://b", None, "http://c"]
    assert len(table) == 2
    table.check_invariants()


def test_forgetting_a_backend_drops_only_its_sessions() -> None:
    table = SessionTable()
    table.put("s1", "http://a", 0.0)
    table.put("s2", "http://b", 0.0)
    table.put("s3", "http://a", 0.0)
    table.put("s3", "http://b", 1.0)  # moved: no longer a's
    assert table.forget_backend("http://a") == 1
    assert table.forget_backend("http://nobody") == 0
    assert [table.get(k, 1.0) for k in ("s1", "s2", "s3")] == [None, "http://b", "http://b"]
    table.check_invariants()


def test_a_late_put_counts_as_seen_at_the_latest_time() -> None:
    """A mirrored dispatch from another worker may carry an earlier ``now``: the entry
    lives as long as one seen at the latest time (the expiry order stays sorted)."""
    table = SessionTable(ttl_s=10.0)
    table.put("s1", "http://a", 5.0)
    table.put("s2", "http://b", 4.0)
    assert table.get("s2", 14.5) == "http://b"
    assert table.expire(15.0) == 2
    table.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ttl_s": 0.0}, "ttl_s"),
        ({"ttl_s": math.nan}, "ttl_s"),
        ({"max_entries": 0}, "max_entries"),
    ],
)
def test_bad_sizes_are_value_errors(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SessionTable(**kwargs)  # type: ignore[arg-type]


def test_session_result_names_where_a_session_went() -> None:
    assert session_result(None, "http://a") == "new"
    assert session_result("http://a", "http://a") == "home"
    assert session_result("http://a", "http://b") == "moved"


class _Model:
    """The reference: a dict of key -> (url, seen, put order); scans where the table
    keeps indexes."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self.entries: dict[str, tuple[str, float, int]] = {}
        self.latest = -math.inf
        self.order = 0

    def get(self, key: str, now: float) -> str | None:
        e = self.entries.get(key)
        return e[0] if e is not None and now - e[1] < self.ttl_s else None

    def expire(self, now: float) -> int:
        gone = [k for k, (_, seen, _) in self.entries.items() if now - seen >= self.ttl_s]
        for k in gone:
            del self.entries[k]
        return len(gone)

    def put(self, key: str, url: str, now: float) -> None:
        self.expire(now)
        self.latest = max(self.latest, now)
        self.order += 1
        self.entries[key] = (url, self.latest, self.order)
        while len(self.entries) > self.max_entries:
            oldest = min(self.entries, key=lambda k: self.entries[k][2])
            del self.entries[oldest]

    def forget_backend(self, url: str) -> int:
        gone = [k for k, e in self.entries.items() if e[0] == url]
        for k in gone:
            del self.entries[k]
        return len(gone)


KEYS = st.sampled_from([f"s{i}" for i in range(8)])
URLS = st.sampled_from([f"http://b{i}" for i in range(3)])


class SessionMachine(RuleBasedStateMachine):
    """Random puts, reads, expiries and removals, with time mostly moving forward; the
    table answers as the reference does and its invariants hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.table: SessionTable | None = None
        self.model: _Model | None = None
        self.now = 0.0

    @precondition(lambda self: self.table is None)
    @rule(ttl_s=st.sampled_from([1.0, 5.0, 30.0]), max_entries=st.integers(1, 6))
    def start(self, ttl_s: float, max_entries: int) -> None:
        self.table = SessionTable(ttl_s=ttl_s, max_entries=max_entries)
        self.model = _Model(ttl_s, max_entries)

    @precondition(lambda self: self.table is not None)
    @rule(key=KEYS, url=URLS, step=st.floats(-1.0, 3.0))
    def put(self, key: str, url: str, step: float) -> None:
        assert self.table is not None and self.model is not None
        now = self.now + step  # a negative step: a late mirrored dispatch
        self.now = max(self.now, now)
        self.table.put(key, url, now)
        self.model.put(key, url, now)

    @precondition(lambda self: self.table is not None)
    @rule(key=KEYS, ahead=st.floats(0.0, 10.0))
    def get(self, key: str, ahead: float) -> None:
        assert self.table is not None and self.model is not None
        now = self.now + ahead
        assert self.table.get(key, now) == self.model.get(key, now)

    @precondition(lambda self: self.table is not None)
    @rule(step=st.floats(0.0, 10.0))
    def expire(self, step: float) -> None:
        assert self.table is not None and self.model is not None
        self.now += step
        assert self.table.expire(self.now) == self.model.expire(self.now)

    @precondition(lambda self: self.table is not None)
    @rule(url=URLS)
    def forget_backend(self, url: str) -> None:
        assert self.table is not None and self.model is not None
        assert self.table.forget_backend(url) == self.model.forget_backend(url)

    @invariant()
    def agrees(self) -> None:
        if self.table is None or self.model is None:
            return
        self.table.check_invariants()
        assert len(self.table) == len(self.model.entries)
        assert len(self.table) <= self.model.max_entries
        for key in [f"s{i}" for i in range(8)]:
            assert self.table.get(key, self.now) == self.model.get(key, self.now)


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
