"""The model of SGLang's cache-aware policy: first creator forever, load only when the
pool is imbalanced or the match is short, periodic eviction by tree size."""

from __future__ import annotations

from kvroute.core.policy import Reason

from .routing_helpers import chain, make_fleet, req, serve, url


def group(g: int, q: int, shared: int = 8) -> list[int]:
    """A prompt of ``shared`` blocks of group ``g`` and 2 blocks of question ``q``."""
    return chain((g, shared), (1000 + q, 2))


def test_a_prefix_goes_to_its_first_worker_whatever_the_load() -> None:
    fleet = make_fleet("sglang-cache-aware", 4)
    first, _ = serve(fleet, req("a", group(1, 0)))
    assert first.reason is Reason.COLD and first.backend == url(0)  # least loaded, first
    for q in range(1, 6):  # b0 gets busier and busier; balanced while max - min <= 64
        d, _ = serve(fleet, req(f"a{q}", group(1, q)))
        assert (d.backend, d.reason) == (url(0), Reason.PREFIX)
        assert d.predicted_cached_tokens == 8 * 16


def test_a_short_match_is_a_miss_and_goes_to_the_least_loaded() -> None:
    fleet = make_fleet("sglang-cache-aware", 4)
    serve(fleet, req("a", group(1, 0)))  # on b0, in flight
    d, _ = serve(fleet, req("b", chain((1, 2), (77, 10))))  # 2 of 12 blocks: under 0.3
    assert (d.backend, d.reason) == (url(1), Reason.COLD)


def test_an_imbalanced_pool_sends_to_the_least_loaded_and_remembers_it_there() -> None:
    fleet = make_fleet("sglang-cache-aware", 2, balance_abs_threshold=3)
    for q in range(4):  # all to the creator: at most 3 - 0 in flight, not over 3
        assert serve(fleet, req(f"a{q}", group(1, q)))[0].backend == url(0)
    d, _ = serve(fleet, req("x", group(1, 99)))  # b0 has 4 in flight, b1 none: 4 - 0 > 3
    assert (d.backend, d.reason) == (url(1), Reason.LOAD)
    again, _ = serve(fleet, req("y", group(1, 98)))  # 4 vs 1: balanced, the creator wins
    assert again.backend == url(0)
    fleet.policy.check_invariants()  # type: ignore[attr-defined]


def test_the_old_miss_rule_picks_the_smallest_tree() -> None:
    fleet = make_fleet("sglang-cache-aware", 3, miss_to_smallest_tree=True)
    _, ticket = serve(fleet, req("a", group(1, 0)))
    fleet.finish(ticket, 1.0, True)  # b0 idle again, but its tree is the biggest
    d, _ = serve(fleet, req("b", group(2, 0)))
    assert d.backend == url(1)


def test_trees_over_the_cap_lose_their_least_recent_nodes() -> None:
    # cap: 2 * 64 characters = 2 blocks of 16 tokens x 4 characters per worker
    fleet = make_fleet("sglang-cache-aware", 1, max_tree_size=128, eviction_interval_s=10.0)
    serve(fleet, req("a", group(1, 0)), now=0.0)
    serve(fleet, req("b", group(2, 0)), now=1.0)  # the tree now holds 20 nodes
    d, _ = serve(fleet, req("c", group(1, 1)), now=11.0)  # eviction ran first: group 1 gone
    assert d.reason is Reason.COLD
    policy = fleet.policy
    policy.check_invariants()  # type: ignore[attr-defined]
    assert len(policy._trees[url(0)]) == 12  # type: ignore[attr-defined] (2 kept + 10 of c)


def test_a_miss_counts_only_its_own_requests_and_ties_go_to_the_least_sent() -> None:
    # SMG never scrapes: another client's 60 requests on b0 do not move it; idle workers
    # tie on load and the one sent fewest requests so far wins (SMG #1714), then the first
    fleet = make_fleet("sglang-cache-aware", 3)
    fleet.update_engine_stats(url(0), num_running=50, num_waiting=10)
    sent = []
    for g in range(6):  # new prefixes, each finished before the next
        d, ticket = serve(fleet, req(f"g{g}", group(10 + g, 0)))
        assert d.reason is Reason.COLD
        fleet.finish(ticket, 1.0, True)
        sent.append(d.backend)
    assert sent == [url(0), url(1), url(2)] * 2
