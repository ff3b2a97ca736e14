"""The model of DualMap (AIBrix ``dualmap``): two hash candidates per prefix, the deeper
hit or else the less loaded of the two, the faster of the two past the TTFT SLO, and
hot prefixes keyed deeper so that they spread over more backends."""

from __future__ import annotations

from kvroute.core.fleet import Fleet
from kvroute.core.policy import Decision, Reason
from kvroute.core.policy.dualmap import DualMapParams, HotPrefixes, candidates

from .routing_helpers import chain, make_fleet, req, serve, url

N = 8


def group(g: int, q: int, shared: int = 8) -> list[int]:
    """``shared`` blocks of group ``g``, then 2 blocks of question ``q``."""
    return chain((g, shared), (1000 + q, 2))


def pair_of(blocks: list[int]) -> tuple[str, ...]:
    return candidates(blocks[0], [url(i) for i in range(N)])


def occupy(fleet: Fleet, u: str, blocks: int, rid: str = "busy") -> None:
    """An unrelated request of ``blocks`` blocks queued for prefill on ``u``."""
    r = req(rid, chain((9000 + len(rid), blocks)))
    fleet.dispatch(Decision(u, Reason.COLD, 0, (u,)), r, 0.0)


def test_the_two_candidates_are_two_backends_fixed_by_the_first_block() -> None:
    urls = [url(i) for i in range(N)]
    seen = set()
    for g in range(40):
        pair = pair_of(group(g, 0))
        assert len(set(pair)) == 2 and pair == pair_of(group(g, 7))  # the question is not keyed
        seen.update(pair)
    assert seen == set(urls)  # prefixes spread over the whole fleet
    assert candidates(5, urls[:1]) == (urls[0],)


def test_a_new_prefix_goes_to_the_less_loaded_of_its_two_candidates() -> None:
    for loaded in (0, 1):
        fleet = make_fleet("aibrix-dualmap", N)
        pair = pair_of(group(1, 0))
        occupy(fleet, pair[loaded], 4)
        d, _ = serve(fleet, req("a", group(1, 0)))
        assert (d.backend, d.reason) == (pair[1 - loaded], Reason.HASH)
        assert d.ranked[:2] == (pair[1 - loaded], pair[loaded])


def test_the_candidate_holding_the_prefix_wins_while_under_the_slo() -> None:
    fleet = make_fleet("aibrix-dualmap", N, capacity=5000, ttft_slo_s=0.2)
    first, ticket = serve(fleet, req("a", group(1, 0)))
    fleet.finish(ticket, 1.0, True)
    other = next(u for u in pair_of(group(1, 0)) if u != first.backend)
    occupy(fleet, first.backend, 50)  # 800 tokens queued: ~0.1 s, under the SLO
    d, _ = serve(fleet, req("b", group(1, 1)), now=1.0)
    assert (d.backend, d.reason, d.predicted_cached_tokens) == (first.backend, Reason.PREFIX, 128)
    occupy(fleet, first.backend, 300, rid="big")  # ~0.5 s more: over 0.2 s
    d, _ = serve(fleet, req("c", group(1, 2)), now=1.0)
    assert (d.backend, d.reason) == (other, Reason.LOAD)
    assert d.ttft_estimate_s is not None and d.ttft_estimate_s < 0.2


def test_past_the_slo_it_stays_when_the_other_candidate_is_no_faster() -> None:
    fleet = make_fleet("aibrix-dualmap", N, capacity=5000, ttft_slo_s=0.2)
    first, ticket = serve(fleet, req("a", group(1, 0)))
    fleet.finish(ticket, 1.0, True)
    other = next(u for u in pair_of(group(1, 0)) if u != first.backend)
    occupy(fleet, first.backend, 300, rid="big")
    occupy(fleet, other, 600, rid="bigger")
    d, _ = serve(fleet, req("c", group(1, 2)), now=1.0)
    assert (d.backend, d.reason) == (first.backend, Reason.PREFIX)


def test_a_hot_prefix_is_keyed_deeper_and_spreads_over_more_backends() -> None:
    fleet = make_fleet("aibrix-dualmap", N, hot_window=50, hot_min_samples=5)
    hot = fleet.policy.hot  # type: ignore[attr-defined]
    used: list[str] = []
    for q in range(40):  # one prefix, every request: hot
        d, ticket = serve(fleet, req(f"h{q}", group(1, q)), now=float(q))
        fleet.finish(ticket, q + 0.5, True)
        used.append(d.backend)
    assert set(used[:5]) <= set(pair_of(group(1, 0)))  # before it is hot: its pair only
    assert hot.depth(group(1, 99)) == 9  # past the 8 shared blocks: keyed by its question
    assert len(set(used[-10:])) > 2  # its questions now hash to pairs of their own
    # a prefix seen now and then stays at one block
    for g in range(2, 40):
        serve(fleet, req(f"c{g}", group(g, 0)), now=50.0)
    assert hot.depth(group(3, 1)) == 1
    hot.check_invariants()


def test_a_cooled_prefix_shrinks_back_one_level_per_request() -> None:
    hot = HotPrefixes(DualMapParams(hot_window=50, hot_min_samples=5, shrink_ratio=0.05))
    prompt = group(1, 0, shared=3)
    others = iter(range(2, 10_000))

    def cool_down() -> None:  # a window of other prefixes
        for _ in range(50):
            other = group(next(others), 0)
            hot.observe(other, hot.depth(other))

    for _ in range(20):
        hot.observe(prompt, hot.depth(prompt))
    assert hot.depth(prompt) == 5  # all of it: 3 shared blocks and the question's 2
    for expected in (4, 3, 2, 1):
        cool_down()
        hot.observe(prompt, hot.depth(prompt))  # 1 of 50 < 5 %: its parent is cold
        assert hot.depth(prompt) == expected
    hot.check_invariants()
