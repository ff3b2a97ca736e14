"""Each policy as a table of named cases; the registry; eligibility and exclude for all."""

from __future__ import annotations

from random import Random

import pytest

from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import POLICIES, Decision, make_policy, policy_names
from tests.core.routing_helpers import BS, chain, make_fleet, req, serve, url

ALL = sorted(POLICIES)


def test_unknown_policy_raises_value_error_listing_names():
    with pytest.raises(ValueError) as err:
        make_policy("fastest")
    for name in (
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "consistent_hash",
        "prefix",
    ):
        assert name in str(err.value)
    assert policy_names() == ALL


def test_decision_must_rank_its_backend_first():
    with pytest.raises(ValueError, match="ranked"):
        Decision("a", "x", 0, ("b", "a"))
    moved = Decision("a", "prefix", 32, ("a", "b", "c")).moved_to("c")
    assert (moved.backend, moved.reason, moved.ranked) == ("c", "retry", ("c", "a", "b"))


@pytest.mark.parametrize("name", ALL)
def test_no_eligible_backend_gives_none(name):
    fleet = make_fleet(name, n=2)
    fleet.set_healthy(url(0), False)
    fleet.set_draining(url(1), True)
    assert fleet.route(req("r", chain((1, 2))), 0.0) is None
    assert make_fleet(name, n=0).route(req("r", chain((1, 2))), 0.0) is None


@pytest.mark.parametrize("name", ALL)
def test_model_aware_eligibility(name):
    fleet = make_fleet(name, n=0)
    fleet.add_backend(url(0), models=["llama"])
    fleet.add_backend(url(1), models=["qwen"])
    fleet.add_backend(url(2), models=["qwen", "llama"])
    fleet.add_backend(url(3))  # models unknown yet: serves any
    for i in range(12):
        decision, ticket = serve(fleet, req(f"r{i}", chain((i, 2)), model="qwen"))
        assert decision.backend in {url(1), url(2), url(3)}
        assert set(decision.ranked) <= {url(1), url(2), url(3)}
        fleet.finish(ticket, 1.0, ok=True)
    fleet.set_models(url(3), ["mistral"])
    assert fleet.route(req("x", chain((1, 2)), model="mistral"), 0.0).backend == url(3)
    assert fleet.route(req("x", chain((1, 2)), model="gpt"), 0.0) is None


@pytest.mark.parametrize("name", ALL)
def test_exclude_is_never_chosen_nor_ranked(name):
    fleet = make_fleet(name, n=3)
    for i in range(10):
        decision, ticket = serve(fleet, req(f"r{i}", chain((i, 2))), exclude=[url(0), url(2)])
        assert decision.backend == url(1) and decision.ranked == (url(1),)
        fleet.finish(ticket, 1.0, ok=True)
    assert fleet.route(req("r", chain((1, 1))), 0.0, exclude=[url(i) for i in range(3)]) is None


@pytest.mark.parametrize("name", ALL)
def test_every_decision_ranks_distinct_eligible_backends(name):
    fleet = make_fleet(name, n=5)
    for i in range(20):
        decision, _ = serve(fleet, req(f"r{i}", chain((i % 4, 3))))
        assert decision.ranked[0] == decision.backend
        assert len(set(decision.ranked)) == len(decision.ranked)


def test_round_robin_cycles_in_url_order():
    fleet = make_fleet("round_robin", n=3)
    got = [serve(fleet, req(f"r{i}", chain((1, 1))))[0].backend for i in range(5)]
    assert got == [url(0), url(1), url(2), url(0), url(1)]


def test_random_is_reproducible_with_a_seeded_rng():
    def run(seed: int) -> list[str]:
        fleet = Fleet(make_policy("random", rng=Random(seed)))
        for i in range(6):
            fleet.add_backend(url(i))
        return [serve(fleet, req(f"r{i}", chain((1, 1))))[0].backend for i in range(30)]

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert len(set(run(3))) > 3


@pytest.mark.parametrize(
    ("case", "busy", "expected"),
    [
        ("idle fleet: rendezvous picks one of all", {}, None),
        ("one busy: the others", {0: 1000}, "not0"),
        ("all busy but one", {0: 500, 1: 300, 2: 900}, url(3)),
        ("least tokens, not fewest requests", {0: 5000, 1: 100, 2: 100, 3: 100}, "not0"),
    ],
)
def test_least_load_table(case, busy, expected):
    fleet = make_fleet("least_load", n=4)
    for i, tokens in busy.items():
        r = req(f"busy{i}", chain((50 + i, 1)), prompt_tokens=tokens, max_tokens=0)
        fleet.dispatch(Decision(url(i), "test", 0, (url(i),)), r, 0.0)
    decision = fleet.route(req("r", chain((7, 2))), 0.0)
    if expected == "not0":
        assert decision.backend != url(0), case
    elif expected is not None:
        assert decision.backend == expected, case


def test_least_load_spreads_a_burst():
    fleet = make_fleet("least_load", n=4)
    got = [serve(fleet, req(f"r{i}", chain((i, 2)), max_tokens=100))[0].backend for i in range(8)]
    assert sorted(got) == sorted([url(i) for i in range(4)] * 2)


def test_power_of_two_never_picks_the_busiest_of_its_pair():
    fleet = make_fleet("power_of_two", n=2)
    heavy = req("heavy", chain((9, 1)), prompt_tokens=10_000)
    fleet.dispatch(Decision(url(0), "test", 0, (url(0),)), heavy, 0.0)
    for i in range(10):
        assert fleet.route(req(f"r{i}", chain((i, 2))), 0.0).backend == url(1)


def test_consistent_hash_is_sticky_per_first_block_and_spreads_prefixes():
    fleet = make_fleet("consistent_hash", n=4)
    homes = {}
    for p in range(40):
        d1 = fleet.route(req("a", chain((p, 1), (1, 2))), 0.0)
        d2 = fleet.route(req("b", chain((p, 1), (2, 5))), 0.0)
        assert d1.backend == d2.backend and d1.reason == "hash"
        homes[p] = d1.backend
    assert len(set(homes.values())) == 4


def test_consistent_hash_bounded_load_moves_off_an_overloaded_home():
    fleet = make_fleet("consistent_hash", n=4, epsilon=0.25)
    r = req("r", chain((3, 2)), max_tokens=100)
    home = fleet.route(r, 0.0).backend
    for i in range(3):  # load the home far above the mean
        heavy = req(f"h{i}", chain((90 + i, 2)), prompt_tokens=1000)
        fleet.dispatch(Decision(home, "test", 0, (home,)), heavy, 0.0)
    moved = fleet.route(r, 0.0)
    assert moved.backend != home
    fleet.remove_backend(moved.backend)  # the ring rebuilds without it
    assert fleet.route(r, 0.0).backend not in (moved.backend, home)


def test_block_size_for_follows_the_scraped_engines():
    fleet = Fleet(make_policy("prefix"), FleetConfig(default_block_size=BS))
    assert fleet.block_size_for(None) == BS
    for i in range(3):
        fleet.add_backend(url(i), models=["m"])
    fleet.update_engine_stats(url(0), block_size=32)
    fleet.update_engine_stats(url(1), block_size=32)
    assert fleet.block_size_for("m") == 32
    fleet.set_healthy(url(0), False)
    fleet.set_healthy(url(1), False)
    assert fleet.block_size_for("m") == BS
