"""The model of llm-d's default profile: prefix 3, queue 2, KV-cache 2, max score with a
random tie-break, an LRU index per server that forgets a prompt's head first; and its
no-hit-lru variant, which sends cold prompts round the fleet."""

from __future__ import annotations

from random import Random

from kvroute.core.fleet import Fleet
from kvroute.core.policy import Reason

from .routing_helpers import chain, make_fleet, req, serve, url


def group(g: int, q: int, shared: int = 8) -> list[int]:
    """A prompt of ``shared`` blocks of group ``g`` and 2 blocks of question ``q``."""
    return chain((g, shared), (1000 + q, 2))


def llmd(n: int = 4, policy: str = "llm-d", **kw: object) -> Fleet:
    return make_fleet(policy, n, rng=Random(7), **kw)


def test_a_shared_prefix_goes_to_its_holder() -> None:
    fleet = llmd()
    first, _ = serve(fleet, req("a", group(1, 0)))
    assert first.reason is Reason.COLD
    for q in range(1, 6):  # the holder's engine looks idle: no scrape yet
        d, _ = serve(fleet, req(f"a{q}", group(1, q)))
        assert (d.backend, d.reason) == (first.backend, Reason.PREFIX)
        assert d.predicted_cached_tokens == 8 * 16  # 8 of the 10 blocks credited


def test_a_busy_holder_keeps_a_full_hit_but_loses_a_short_one_to_an_idle_server() -> None:
    fleet = llmd(2)
    holder, _ = serve(fleet, req("a", chain((1, 10))))
    other = url(1) if holder.backend == url(0) else url(0)
    fleet.update_engine_stats(holder.backend, num_waiting=5)
    fleet.update_engine_stats(other, num_waiting=0)
    # a full hit: 3 x 1.0 + 2 x 0 (longest queue) beats 0 + 2 x 1.0 (shortest)
    full, _ = serve(fleet, req("b", chain((1, 10))))
    assert (full.backend, full.reason) == (holder.backend, Reason.PREFIX)
    # 4 of 10 blocks: 3 x 0.4 = 1.2 < the queue's 2: the idle server, diverted for load
    short, _ = serve(fleet, req("c", chain((1, 4), (9, 6))))
    assert (short.backend, short.reason) == (other, Reason.LOAD)


def test_kv_cache_usage_weighs_like_the_queue() -> None:
    fleet = llmd(2)
    holder, _ = serve(fleet, req("a", chain((1, 10))))
    other = url(1) if holder.backend == url(0) else url(0)
    fleet.update_engine_stats(holder.backend, kv_cache_usage=0.9)  # queues equal: 1.0 each
    fleet.update_engine_stats(other, kv_cache_usage=0.1)
    # half a hit: 1.5 + 2 + 0.2 on the holder, 2 + 2 + 1.8 on the other
    d, _ = serve(fleet, req("b", chain((1, 5), (9, 5))))
    assert d.backend == other


def test_ties_break_at_random_and_repeat_with_the_seed() -> None:
    def backends(seed: int) -> list[str]:
        fleet = make_fleet("llm-d", 4, rng=Random(seed))
        return [serve(fleet, req(f"r{i}", group(i, 0)))[0].backend for i in range(40)]

    assert len(set(backends(1))) == 4  # cold prompts, equal scores: spread by the shuffle
    assert backends(1) == backends(1) and backends(1) != backends(2)


def test_the_index_forgets_a_prompts_head_first_and_stops_matching_there() -> None:
    fleet = llmd(1)
    fleet.update_engine_stats(url(0), num_gpu_blocks=12)  # autoTune: the LRU holds 12
    serve(fleet, req("a", chain((1, 10))))
    serve(fleet, req("b", chain((2, 10))))  # 20 hashes: a's first 8 go, its last 2 stay
    again, _ = serve(fleet, req("a2", chain((1, 10))))
    assert (again.reason, again.predicted_cached_tokens) == (Reason.COLD, 0)
    fleet.policy.check_invariants()  # type: ignore[attr-defined]
    lru = fleet.policy._lrus[url(0)]  # type: ignore[attr-defined]
    assert len(lru) == 12


def test_without_auto_tune_the_lru_has_its_configured_size() -> None:
    fleet = llmd(1, auto_tune=False, lru_capacity_per_server=5)
    fleet.update_engine_stats(url(0), num_gpu_blocks=1000)
    serve(fleet, req("a", chain((1, 10))))
    assert len(fleet.policy._lrus[url(0)]) == 5  # type: ignore[attr-defined]


def test_no_hit_lru_sends_cold_prompts_round_the_fleet() -> None:
    fleet = llmd(4, "llm-d-no-hit-lru")
    cold = [serve(fleet, req(f"c{i}", group(i, 0)))[0] for i in range(8)]
    assert [d.backend for d in cold] == [url(i % 4) for i in range(8)]
    assert {d.reason for d in cold} == {Reason.COLD}
    warm, _ = serve(fleet, req("w", group(2, 1)))  # a hit: 0.5 everywhere, the holder wins
    assert (warm.backend, warm.reason) == (url(2), Reason.PREFIX)
    nxt, _ = serve(fleet, req("c8", group(8, 0)))  # the warm one did not move the LRU
    assert nxt.backend == url(0)


def test_the_default_profile_has_no_no_hit_lru() -> None:
    assert make_fleet("llm-d").policy.p.no_hit_lru_weight == 0  # type: ignore[attr-defined]
    fleet = make_fleet("llm-d-no-hit-lru", no_hit_lru_weight=0.5)
    assert fleet.policy.p.no_hit_lru_weight == 0.5  # type: ignore[attr-defined]
