"""The model of KubeAI's CHWBL: a prefix stays on its ring owner while that owner is
within 1.25 x the mean in-flight requests, then walks the ring; bounded loads hold."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvroute.core.fleet import Fleet
from kvroute.core.policy import Reason

from .routing_helpers import chain, make_fleet, req, serve, url


def prompt(g: int, q: int) -> list[int]:
    """Two blocks of group ``g`` (the first 128 characters: the key) and 6 of ``q``."""
    return chain((g, 2), (1000 + q, 6))


def ring_order(fleet: Fleet, blocks: list[int]) -> list[str]:
    policy: Any = fleet.policy
    return list(policy._ring.walk(policy._key(req("k", blocks), 16)))


def test_a_prefix_stays_on_its_owner_while_nothing_piles_up() -> None:
    fleet = make_fleet("chwbl", 4)
    owners = set()
    for q in range(10):  # each finishes before the next: load never over the bound
        d, ticket = serve(fleet, req(f"a{q}", prompt(1, q)))
        assert d.reason is Reason.HASH and d.predicted_cached_tokens == 0
        owners.add(d.backend)
        fleet.finish(ticket, 1.0, True)
    assert owners == {ring_order(fleet, prompt(1, 0))[0]}


def test_over_the_bound_it_walks_the_ring_in_order() -> None:
    fleet = make_fleet("chwbl", 4)
    got = [serve(fleet, req(f"a{q}", prompt(1, q)))[0] for q in range(7)]
    order = ring_order(fleet, prompt(1, 0))
    # nothing finishes; bound 1.25 x (in flight + 1) / 4 = -, 0.63, 0.94, 1.25, 1.56, ...:
    # one hot prefix fills three backends in ring order and never needs the fourth
    assert [d.backend for d in got] == [order[i] for i in (0, 1, 2, 0, 1, 2, 0)]
    hash_, load = Reason.HASH, Reason.LOAD
    assert [d.reason for d in got] == [hash_, load, load, hash_, load, load, hash_]


def test_bounded_loads_hold_for_one_hot_prefix() -> None:
    fleet = make_fleet("chwbl", 5)
    loads: Counter[str] = Counter()
    for q in range(60):  # nothing finishes
        d, _ = serve(fleet, req(f"h{q}", prompt(7, q)))
        total = sum(loads.values())
        assert loads[d.backend] <= 1.25 * (total + 1) / 5  # the chosen one was within it
        loads[d.backend] += 1
    assert max(loads.values()) <= 1.25 * 60 / 5 + 1


def test_the_key_is_the_prompts_first_hundred_characters() -> None:
    fleet = make_fleet("chwbl", 4)
    policy = fleet.policy
    assert policy._key(req("a", prompt(1, 1)), 16) == policy._key(req("b", prompt(1, 2)), 16)  # type: ignore[attr-defined]
    other = chain((1, 1), (5, 7))  # the same first 64 characters, not the next 36
    assert policy._key(req("c", other), 16) != policy._key(req("a", prompt(1, 1)), 16)  # type: ignore[attr-defined]


def test_distinct_prefixes_spread_over_the_ring() -> None:
    fleet = make_fleet("chwbl", 4)
    counts: Counter[str] = Counter()
    for g in range(400):
        d, ticket = serve(fleet, req(f"g{g}", prompt(g, 0)))
        counts[d.backend] += 1
        fleet.finish(ticket, 1.0, True)
    assert set(counts) == {url(i) for i in range(4)}
    assert min(counts.values()) > 60  # 256 points each: no backend far below its 100


def test_load_is_its_own_count_not_the_engines_gauges() -> None:
    # KubeAI's proxy counts the requests it sent; another client's 60 on the owner do not
    # push this prefix off it
    fleet = make_fleet("chwbl", 4)
    _, ticket = serve(fleet, req("ring", prompt(9, 0)))  # the ring is built on first use
    fleet.finish(ticket, 1.0, True)
    owner = ring_order(fleet, prompt(3, 0))[0]
    fleet.update_engine_stats(owner, num_running=50, num_waiting=10)
    d, _ = serve(fleet, req("a", prompt(3, 0)))
    assert (d.backend, d.reason) == (owner, Reason.HASH)
