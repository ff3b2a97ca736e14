"""The Fleet end to end: membership, engine stats, states, and a stateful property test."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy, policy_names
from kvroute.core.policy.base import Decision, FleetView, Policy, RouteRequest
from kvroute.core.policy.least_load import LeastLoadPolicy
from tests.core.routing_helpers import BS, chain, make_fleet, req, serve, url


def test_membership_errors_are_value_errors():
    fleet = make_fleet(n=1)
    with pytest.raises(ValueError, match="already"):
        fleet.add_backend(url(0))
    with pytest.raises(ValueError, match="weight"):
        fleet.add_backend(url(9), weight=0)
    with pytest.raises(ValueError, match="unknown backend"):
        fleet.set_healthy(url(5), False)
    fleet.remove_backend(url(5))  # unknown: no-op
    fleet.update_engine_stats(url(5), num_running=3)  # scrape racing a removal


def test_removed_backend_vanishes_from_index_and_decisions():
    fleet = make_fleet(n=2)
    system = chain((1, 8))
    d, t = serve(fleet, req("a", system))
    fleet.remove_backend(d.backend)
    assert fleet.index.holders(system[0]) == set()
    assert d.backend not in fleet.urls()
    again = fleet.route(req("b", system), 1.0)
    assert again.backend != d.backend and again.reason == "cold"
    fleet.finish(t, 2.0, ok=True)  # the old ticket's end is harmless
    fleet.check_invariants()


def test_engine_stats_feed_capacity_block_size_and_hit_deltas():
    fleet = make_fleet(n=1)
    u = url(0)
    fleet.update_engine_stats(u, prefix_cache_hits=1000, prefix_cache_queries=4000)
    fleet.update_engine_stats(
        u,
        prefix_cache_hits=1600,
        prefix_cache_queries=5000,
        num_gpu_blocks=3,
        block_size=BS,
        kv_cache_usage=0.4,
        num_running=2,
        num_waiting=1,
    )
    fleet.update_engine_stats(u, prefix_cache_hits=50, prefix_cache_queries=100)  # restart
    (s,) = fleet.backend_states()
    assert (s.engine_hit_tokens, s.engine_query_tokens) == (650, 1100)
    assert (s.capacity_blocks, s.block_size, s.kv_cache_usage) == (3, BS, 0.4)
    assert (s.engine_num_running, s.engine_num_waiting, s.in_flight_requests) == (2, 1, 3)
    serve(fleet, req("a", chain((1, 5))))
    assert fleet.backend_states()[0].index_blocks == 3  # the scraped capacity bounds the model


def test_by_default_the_index_is_as_big_as_the_engines_caches_together():
    fleet = make_fleet(n=3, capacity=1000)
    models = fleet.index.url_to_model
    assert fleet.index.max_entries == sum(m.capacity_blocks for m in models.values())
    before, small = fleet.index.max_entries, models[url(0)].capacity_blocks
    fleet.update_engine_stats(url(0), num_gpu_blocks=50_000, block_size=BS)  # a big engine
    assert models[url(0)].capacity_blocks > small
    assert fleet.index.max_entries == before + models[url(0)].capacity_blocks - small
    fleet.remove_backend(url(1))
    assert fleet.index.max_entries == sum(m.capacity_blocks for m in models.values())
    capped = Fleet(make_policy("prefix"), FleetConfig(max_index_entries=7))
    capped.add_backend(url(0))
    assert capped.index.max_entries == 7  # a number is a hard cap


def test_states_compare_predicted_and_reported_hits():
    fleet = make_fleet(n=1)
    _, t1 = serve(fleet, req("a", chain((1, 4)), prompt_tokens=70))
    fleet.on_first_token(t1, 0.1, cached_tokens=0)
    fleet.finish(t1, 0.2, ok=True)
    _, t2 = serve(fleet, req("b", chain((1, 4)), prompt_tokens=70), now=1.0)
    fleet.on_first_token(t2, 1.1)
    fleet.finish(t2, 1.2, ok=False)
    fleet.record_cached_tokens(t2, 48)  # a stream's usage arrives with its last chunk
    fleet.record_cached_tokens(t2, 60)  # only the first report counts
    (s,) = fleet.backend_states()
    assert (s.predicted_hit_tokens, s.predicted_query_tokens) == (64, 140)
    assert (s.reported_hit_tokens, s.reported_query_tokens) == (48, 140)
    assert (s.num_dispatched, s.num_failed) == (2, 1)


def test_draining_backend_gets_no_new_work_but_keeps_its_load_until_finish():
    fleet = make_fleet("least_load", n=2)
    d, t = serve(fleet, req("a", chain((1, 2))))
    fleet.set_draining(d.backend, True)
    for i in range(5):
        assert fleet.route(req(f"r{i}", chain((i, 2))), 0.0).backend != d.backend
    assert next(s for s in fleet.backend_states() if s.url == d.backend).in_flight_requests == 1
    fleet.finish(t, 1.0, ok=True)
    fleet.set_draining(d.backend, False)
    fleet.check_invariants()


class FleetMachine(RuleBasedStateMachine):
    """Random traffic, health flips, scrapes and removals; invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        config = FleetConfig(
            default_block_size=BS, default_capacity_blocks=12, max_index_entries=30
        )
        self.fleet = Fleet(make_policy("prefix"), config)
        self.tickets = []
        self.next_id = 0
        for i in range(3):
            self.fleet.add_backend(url(i))
        self.now = 0.0

    @rule(
        prefix=st.integers(0, 4),
        tail=st.integers(0, 50),
        blocks=st.integers(0, 6),
        policy_exclude=st.booleans(),
        session=st.none() | st.sampled_from(["s0", "s1", "s2"]),
    )
    def request(self, prefix, tail, blocks, policy_exclude, session):
        self.now += 0.01
        r = req(f"r{self.next_id}", chain((prefix, 2), (tail, blocks)), max_tokens=8)
        r = dataclasses.replace(r, session=session)
        self.next_id += 1
        exclude = self.fleet.urls()[:1] if policy_exclude else []
        decision = self.fleet.route(r, self.now, exclude=exclude)
        if decision is not None:
            assert decision.backend not in exclude
            self.tickets.append(self.fleet.dispatch(decision, r, self.now))

    @rule(pick=st.integers(0, 1000), cached=st.none() | st.integers(0, 200))
    def first_token(self, pick, cached):
        if self.tickets:
            self.fleet.on_first_token(self.tickets[pick % len(self.tickets)], self.now, cached)

    @rule(pick=st.integers(0, 1000), ok=st.booleans())
    def finish(self, pick, ok):
        if self.tickets:
            self.fleet.finish(self.tickets[pick % len(self.tickets)], self.now, ok)

    @rule(i=st.integers(0, 5), healthy=st.booleans(), draining=st.booleans())
    def flip(self, i, healthy, draining):
        if url(i) in self.fleet.urls():
            self.fleet.set_healthy(url(i), healthy)
            self.fleet.set_draining(url(i), draining)

    @rule(
        i=st.integers(0, 5),
        running=st.integers(0, 5),
        waiting=st.integers(0, 5),
        blocks=st.integers(1, 20),
    )
    def scrape(self, i, running, waiting, blocks):
        self.fleet.update_engine_stats(
            url(i), num_running=running, num_waiting=waiting, num_gpu_blocks=blocks
        )

    @rule(i=st.integers(0, 5))
    def remove_or_add(self, i):
        if url(i) in self.fleet.urls():
            self.fleet.remove_backend(url(i))
        else:
            self.fleet.add_backend(url(i))

    @invariant()
    def consistent(self):
        self.fleet.check_invariants()

    def teardown(self):
        for t in self.tickets:
            self.fleet.finish(t, self.now + 1, ok=True)
        self.fleet.check_invariants()
        for s in self.fleet.backend_states():
            assert s.in_flight_tokens == 0 or s.engine_num_running or s.engine_num_waiting


TestFleetMachine = FleetMachine.TestCase
TestFleetMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_survives_a_mixed_story(name):
    fleet = make_fleet(name, n=3, capacity=20)
    tickets = []
    for i in range(30):
        _, t = serve(fleet, req(f"r{i}", chain((i % 3, 4), (i, 2))), now=i * 0.01)
        tickets.append(t)
        if i % 4 == 0:
            fleet.on_first_token(tickets[i // 2], i * 0.01 + 0.005)
        if i == 15:
            fleet.remove_backend(url(1))
    for t in tickets:
        fleet.finish(t, 1.0, ok=True)
    fleet.check_invariants()
    assert all(s.in_flight_requests == 0 for s in fleet.backend_states())


class _Recorder:
    """A FleetListener that writes down what it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[object, ...]] = []

    def on_dispatch(self, ticket, decision, req, now) -> None:  # type: ignore[no-untyped-def]
        self.heard.append(("dispatch", ticket.ticket_id, decision.backend, req.request_id))

    def on_first_token(self, ticket, now, cached_tokens) -> None:  # type: ignore[no-untyped-def]
        self.heard.append(("first", ticket.ticket_id, cached_tokens))

    def on_cached_tokens(self, ticket, cached_tokens) -> None:  # type: ignore[no-untyped-def]
        self.heard.append(("cached", ticket.ticket_id, cached_tokens))

    def on_finish(self, ticket, now, ok) -> None:  # type: ignore[no-untyped-def]
        self.heard.append(("finish", ticket.ticket_id, ok))


def test_listeners_hear_each_change_once() -> None:
    """Repeated first tokens, reports and finishes change nothing, so nobody hears them."""
    fleet = make_fleet()
    recorder = _Recorder()
    fleet.listeners.append(recorder)
    decision, ticket = serve(fleet, req("a", chain((1, 4))))
    fleet.on_first_token(ticket, 0.1, 32)
    fleet.on_first_token(ticket, 0.2, 48)
    fleet.record_cached_tokens(ticket, 16)
    fleet.finish(ticket, 0.3, True)
    fleet.finish(ticket, 0.4, False)
    _, second = serve(fleet, req("b", chain((2, 4))), 1.0)
    fleet.on_first_token(second, 1.1)
    fleet.record_cached_tokens(second, 0)
    fleet.record_cached_tokens(second, 16)
    fleet.finish(second, 1.2, False)
    t1, t2 = ticket.ticket_id, second.ticket_id
    assert recorder.heard == [
        ("dispatch", t1, decision.backend, "a"),
        ("first", t1, 32),
        ("finish", t1, True),
        ("dispatch", t2, second.url, "b"),
        ("first", t2, None),
        ("cached", t2, 0),
        ("finish", t2, False),
    ]
    assert ticket.reported_cached_tokens == 32
    fleet.check_invariants()


class _SessionProbe(Policy):
    """Least load, writing down what the view offered as the request's session home."""

    name = "session_probe"

    def __init__(self) -> None:
        self.offered: list[str | None] = []
        self._inner = LeastLoadPolicy()

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        self.offered.append(view.session_backend(request.session))
        return self._inner.choose(request, view, now)


def _session_fleet(**config: float) -> tuple[Fleet, _SessionProbe]:
    probe = _SessionProbe()
    fleet = Fleet(probe, FleetConfig(default_block_size=BS, **config))  # type: ignore[arg-type]
    for i in range(3):
        fleet.add_backend(url(i), models=["m1", "m2"])
    return fleet, probe


def _sreq(request_id: str, session: str | None, model: str | None = "m1") -> RouteRequest:
    return dataclasses.replace(req(request_id, chain((7, 2)), model=model), session=session)


def test_a_dispatch_records_its_session_and_the_view_offers_it_while_eligible() -> None:
    fleet, probe = _session_fleet()
    d, t = serve(fleet, _sreq("a", "s1"))
    home = d.backend
    assert fleet.session_backend(_sreq("x", "s1"), 1.0) == home
    assert fleet.num_sessions(1.0) == 1
    fleet.route(_sreq("b", "s1"), 1.0)
    fleet.route(_sreq("c", "s1"), 1.0, exclude=[home])  # a retry must leave it
    fleet.route(_sreq("d", "s1", model="m2"), 1.0)  # the same id on another model: new
    fleet.route(_sreq("e", None), 1.0)
    assert probe.offered == [None, home, None, None, None]
    for change in ("draining", "unhealthy"):
        probe.offered.clear()
        if change == "draining":
            fleet.set_draining(home, True)
        else:
            fleet.set_healthy(home, False)
        fleet.route(_sreq("f", "s1"), 1.0)
        assert probe.offered == [None], change  # never a dead or draining home
        assert fleet.session_backend(_sreq("x", "s1"), 1.0) == home  # still recorded
        fleet.set_draining(home, False)
        fleet.set_healthy(home, True)
    fleet.finish(t, 2.0, ok=True)
    fleet.check_invariants()


def test_a_session_follows_its_last_dispatch_and_expires_after_its_ttl() -> None:
    fleet, _ = _session_fleet(session_ttl_s=10.0)
    d, _ = serve(fleet, _sreq("a", "s1"), now=0.0)
    other = next(u for u in fleet.urls() if u != d.backend)
    fleet.dispatch(Decision(other, "retry", 0, (other,)), _sreq("b", "s1"), 5.0)
    assert fleet.session_backend(_sreq("x", "s1"), 14.9) == other
    assert fleet.session_backend(_sreq("x", "s1"), 15.0) is None
    assert fleet.num_sessions(15.0) == 0


def test_removing_a_backend_forgets_its_sessions() -> None:
    fleet, _ = _session_fleet()
    d, _ = serve(fleet, _sreq("a", "s1"))
    other = next(u for u in fleet.urls() if u != d.backend)
    fleet.dispatch(Decision(other, "load", 0, (other,)), _sreq("b", "s2"), 0.0)
    fleet.remove_backend(d.backend)
    assert fleet.session_backend(_sreq("x", "s1"), 0.0) is None
    assert fleet.session_backend(_sreq("x", "s2"), 0.0) == other
    assert fleet.num_sessions(0.0) == 1
    fleet.check_invariants()


def test_the_session_table_is_bounded_by_the_config() -> None:
    fleet, _ = _session_fleet(session_max_entries=2)
    for i in range(5):
        serve(fleet, _sreq(f"r{i}", f"s{i}"), now=float(i))
    assert fleet.num_sessions(5.0) == 2
    assert fleet.session_backend(_sreq("x", "s0"), 5.0) is None
    assert fleet.session_backend(_sreq("x", "s4"), 5.0) is not None


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"session_ttl_s": 0.0}, "session_ttl_s"), ({"session_max_entries": 0}, "session_max")],
)
def test_bad_session_sizes_name_the_field(changes: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FleetConfig(**changes)  # type: ignore[arg-type]


def test_a_dispatch_that_fails_records_no_session() -> None:
    fleet, _ = _session_fleet()

    class Failing(_Recorder):
        def on_dispatch(self, ticket, decision, req, now) -> None:  # type: ignore[no-untyped-def]
            raise RuntimeError("listener bug")

    fleet.listeners.append(Failing())
    d = fleet.route(_sreq("a", "s1"), 0.0)
    assert d is not None
    with pytest.raises(RuntimeError):
        fleet.dispatch(d, _sreq("a", "s1"), 0.0)
    assert fleet.session_backend(_sreq("x", "s1"), 0.0) is None
    assert fleet.num_sessions(0.0) == 0
    fleet.check_invariants()


def test_a_prompt_the_engine_will_refuse_is_routed_but_leaves_the_cache_model_alone():
    # An 80k-token prompt over a 32k context: the engine answers 400 and caches nothing.
    # Recorded, its blocks would push real prefixes out of the backend's cache model.
    fleet = make_fleet(n=2, capacity=100)
    home = chain((1, 60))
    decision, ticket = serve(fleet, req("a", home))
    held = fleet.index.num_blocks(decision.backend)
    assert held == 60
    huge = dataclasses.replace(req("b", chain((2, 5000))), cacheable=False)
    refused, refused_ticket = serve(fleet, huge, 1.0)
    assert fleet.index.num_blocks(refused.backend) == (
        held if refused.backend == decision.backend else 0
    )
    assert fleet.predicted_cached_tokens(decision.backend, req("c", home)) > 0  # still home
    fleet.finish(refused_ticket, 1.1, True)  # the proxy relays the 400: the backend did fine
    fleet.finish(ticket, 2.0, True)
    fleet.check_invariants()
    assert all(s.in_flight_requests == 0 for s in fleet.backend_states())
