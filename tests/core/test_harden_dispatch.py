"""Hardening of the Fleet's request path (issue 9, finding 1).

Whatever numbers reach it, ``dispatch`` either succeeds (and ``finish`` then releases
everything) or raises having changed nothing: a ticket that is never handed back is load
that is never released.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.backend import BackendState
from kvroute.core.fleet import Fleet
from kvroute.core.load import Ticket
from kvroute.core.policy import RouteRequest, policy_names
from tests.core.routing_helpers import chain, make_fleet, req, serve, url

HUGE = (10**308, 10**400, 2**64, 2**1100)


def _snapshot(fleet: Fleet) -> list[BackendState]:
    return fleet.backend_states()


def _assert_idle(fleet: Fleet) -> None:
    fleet.check_invariants()
    for s in fleet.backend_states():
        assert s.own_in_flight_requests == 0, s.url
        assert s.in_flight_tokens == 0 or s.engine_num_running or s.engine_num_waiting, s.url


@pytest.mark.parametrize("huge", HUGE, ids=["1e308", "1e400", "2^64", "2^1100"])
@pytest.mark.parametrize("name", ["least_load", "prefix", "power_of_two"])
def test_huge_token_counts_dispatch_and_release_cleanly(name: str, huge: int) -> None:
    """10**308 once made the merged load overflow after the load was taken."""
    fleet = make_fleet(name, n=2)
    for u in fleet.urls():
        fleet.update_engine_stats(u, num_running=8, num_waiting=8)
    tickets = []
    for i in range(8):
        r = req(f"h{i}", chain((i, 2)), prompt_tokens=huge, max_tokens=huge)
        _, t = serve(fleet, r, now=i * 0.01)
        tickets.append(t)
    states = fleet.backend_states()  # /metrics reads these: must not raise
    assert all(math.isfinite(s.in_flight_tokens / s.weight) for s in states)
    for t in tickets:
        fleet.on_first_token(t, 1.0, cached_tokens=huge)
        fleet.finish(t, 2.0, ok=True)
    _assert_idle(fleet)
    # both backends still take traffic once the engines are idle again
    for u in fleet.urls():
        fleet.update_engine_stats(u, num_running=0, num_waiting=0)
    chosen = set()
    for i in range(6):
        _, t = serve(fleet, req(f"n{i}", chain((100 + i, 2))), now=3.0)
        chosen.add(t.url)
    assert chosen == set(fleet.urls())


class _Failing:
    """A FleetListener that raises on dispatch (the contract says it must not)."""

    def on_dispatch(self, ticket, decision, req, now) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("listener bug")

    def on_first_token(self, ticket, now, cached_tokens) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("listener bug")

    def on_cached_tokens(self, ticket, cached_tokens) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("listener bug")

    def on_finish(self, ticket, now, ok) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("listener bug")


def test_a_dispatch_that_fails_changes_nothing() -> None:
    fleet = make_fleet("least_load", n=2)
    _, held = serve(fleet, req("held", chain((1, 2))))
    before = _snapshot(fleet)
    r = req("x", chain((2, 2)))
    decision = fleet.route(r, 0.0)
    assert decision is not None
    fleet.listeners.append(_Failing())
    with pytest.raises(RuntimeError, match="listener bug"):
        fleet.dispatch(decision, r, 0.0)
    fleet.listeners.clear()
    unhashable = RouteRequest("y", None, [[1]], 40, 8)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        fleet.dispatch(decision, unhashable, 0.0)
    fleet.check_invariants()
    after = _snapshot(fleet)
    assert [(s.own_in_flight_requests, s.in_flight_tokens, s.num_dispatched) for s in after] == [
        (s.own_in_flight_requests, s.in_flight_tokens, s.num_dispatched) for s in before
    ]
    fleet.finish(held, 1.0, ok=True)
    _assert_idle(fleet)


def test_finish_releases_even_when_a_listener_raises() -> None:
    fleet = make_fleet("least_load", n=1)
    _, t = serve(fleet, req("a", chain((1, 2))))
    fleet.listeners.append(_Failing())
    with pytest.raises(RuntimeError):
        fleet.on_first_token(t, 0.5, cached_tokens=16)
    with pytest.raises(RuntimeError):
        fleet.finish(t, 1.0, ok=True)
    fleet.listeners.clear()
    _assert_idle(fleet)


def test_absurd_engine_gauges_do_not_break_routing() -> None:
    """Scraped values are the engine's word, not ours: inf, nan and huge are survivable."""
    fleet = make_fleet("prefix", n=2)
    u0, u1 = fleet.urls()
    fleet.update_engine_stats(
        u0,
        num_running=10**400,
        num_waiting=math.inf,  # type: ignore[arg-type]
        kv_cache_usage=math.nan,
        block_size=10**400,
        num_gpu_blocks=10**400,
        prefix_cache_hits=math.inf,  # type: ignore[arg-type]
        prefix_cache_queries=math.nan,  # type: ignore[arg-type]
    )
    fleet.update_engine_stats(u1, block_size=math.inf)  # type: ignore[arg-type]
    assert fleet.block_size_for(None) == 16  # neither absurd size is taken
    _, t = serve(fleet, req("a", chain((1, 4))))
    assert [s.url for s in fleet.backend_states()] == [u0, u1]
    fleet.finish(t, 1.0, ok=True)
    fleet.check_invariants()


extreme = st.one_of(
    st.integers(-(2**1100), 2**1100),
    st.sampled_from([0, 1, -1, 2**53, 2**63, 2**64, 10**308, 10**309]),
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(policy_names()),
    requests=st.lists(st.tuples(extreme, extreme, st.integers(0, 6)), min_size=1, max_size=8),
    gauges=st.tuples(extreme, extreme),
    cached=st.one_of(st.none(), extreme),
)
def test_extreme_requests_never_leave_load_behind(
    name: str,
    requests: list[tuple[int, int, int]],
    gauges: tuple[int, int],
    cached: int | None,
) -> None:
    fleet = make_fleet(name, n=3)
    fleet.update_engine_stats(url(0), num_running=gauges[0], num_waiting=gauges[1])
    tickets: list[Ticket] = []
    for i, (prompt, max_tokens, blocks) in enumerate(requests):
        r = req(f"r{i}", chain((i, blocks)), prompt_tokens=prompt, max_tokens=max_tokens)
        decision = fleet.route(r, 0.0)
        assert decision is not None
        tickets.append(fleet.dispatch(decision, r, 0.0))
        fleet.check_invariants()
    fleet.backend_states()
    for t in tickets:
        fleet.on_first_token(t, 0.5, cached)
        fleet.finish(t, 1.0, ok=True)
    fleet.update_engine_stats(url(0), num_running=0, num_waiting=0)
    _assert_idle(fleet)
    assert all(s.in_flight_tokens == 0 for s in fleet.backend_states())
