"""The model of NVIDIA Dynamo's KV router: prefill blocks x weight + active decode blocks,
argmin (ties to the least cached state) or softmax, busy workers out, and its two
indexers (its own TTL record of decisions; the engines' KV events in exact mode)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.fleet import Fleet
from kvroute.core.policy import Decision, Reason
from kvroute.core.policy.dynamo import PredictedBlocks, softmax_pick
from tests.exact import helpers as ex

from .routing_helpers import chain, make_fleet, req, serve, url


def group(g: int, q: int) -> list[int]:
    """8 shared blocks of group ``g``, then 2 blocks of question ``q``."""
    return chain((g, 8), (1000 + q, 2))


def decoding_on(fleet: Fleet, u: str, n: int, blocks: int = 10) -> None:
    """``n`` unrelated requests in flight on ``u``, past their prefill (decoding)."""
    for i in range(n):
        r = req(f"busy-{u}-{i}", chain((5000 + 100 * i + len(u), blocks)))
        ticket = fleet.dispatch(Decision(u, Reason.COLD, 0, (u,)), r, 0.0)
        fleet.on_first_token(ticket, 0.0)


def test_the_worker_holding_the_prefix_wins_unless_its_decode_blocks_outweigh_it() -> None:
    fleet = make_fleet("dynamo", 2, rng=Random(1))
    first, ticket = serve(fleet, req("a", group(1, 0)))
    fleet.finish(ticket, 1.0, True)
    holder = first.backend
    other = url(1) if holder == url(0) else url(0)
    d, ticket = serve(fleet, req("b", group(1, 1)), now=1.0)
    assert (d.backend, d.reason, d.predicted_cached_tokens) == (holder, Reason.PREFIX, 8 * 16)
    fleet.finish(ticket, 2.0, True)
    # 30 blocks decoding on the holder: 37/16 prefill + 40 decode > 165/16 + 10 elsewhere
    decoding_on(fleet, holder, 3)
    d = fleet.route(req("c", group(1, 2)), 2.0)
    assert d is not None and (d.backend, d.reason) == (other, Reason.LOAD)
    # prefill blocks weighing 5x: 5 x 37/16 + 40 < 5 x 165/16 + 10, the holder again
    heavy = make_fleet("dynamo", 2, rng=Random(1), overlap_score_weight=5.0)
    first, ticket = serve(heavy, req("a", group(1, 0)))
    heavy.finish(ticket, 1.0, True)
    decoding_on(heavy, first.backend, 3)
    d = heavy.route(req("c", group(1, 2)), 2.0)
    assert d is not None and (d.backend, d.reason) == (first.backend, Reason.PREFIX)


def test_a_prefix_shared_by_requests_in_flight_counts_once_in_the_decode_blocks() -> None:
    fleet = make_fleet("dynamo", 2)
    for q in range(2):  # on b0: 8 shared + 2 + 2 = 12 distinct blocks (20 with repeats)
        r = req(f"g{q}", group(1, q))
        fleet.on_first_token(fleet.dispatch(Decision(url(0), Reason.COLD, 0, (url(0),)), r, 0), 0)
    decoding_on(fleet, url(1), 1, blocks=13)
    d = fleet.route(req("x", chain((9, 4))), 1.0)
    assert d is not None and d.backend == url(0)  # 12 + 4 < 13 + 4


def test_temperature_zero_is_the_argmin_whatever_the_seed_and_ties_go_to_the_least_cached() -> None:
    for seed in range(5):
        fleet = make_fleet("dynamo", 3, rng=Random(seed))
        decoding_on(fleet, url(0), 1, blocks=4)
        decoding_on(fleet, url(1), 1, blocks=2)
        decoding_on(fleet, url(2), 1, blocks=3)
        d, ticket = serve(fleet, req("x", chain((7, 4))))
        assert d.backend == url(1)  # 2 active blocks: the cheapest
        fleet.finish(ticket, 1.0, True)
        # equal costs: the worker with less in the record (the least cached state)
        fleet2 = make_fleet("dynamo", 2, rng=Random(seed))
        first, t = serve(fleet2, req("a", chain((1, 4))))
        fleet2.finish(t, 1.0, True)
        second, _ = serve(fleet2, req("b", chain((2, 4))), now=1.0)
        assert second.backend != first.backend and second.reason is Reason.COLD


def test_temperature_samples_in_proportion_to_exp_of_minus_the_normalised_cost() -> None:
    rng = Random(3)
    cost = {"a": 10.0, "b": 20.0, "c": 20.0}
    picks = Counter(softmax_pick(list(cost), cost, 1.0, rng) for _ in range(6000))
    # exp(0) : exp(-1) : exp(-1) -> 0.576, 0.212, 0.212
    assert abs(picks["a"] / 6000 - 0.576) < 0.03
    assert abs(picks["b"] / 6000 - 0.212) < 0.03
    equal = Counter(softmax_pick(["a", "b"], {"a": 1.0, "b": 1.0}, 0.5, rng) for _ in range(2000))
    assert abs(equal["a"] / 2000 - 0.5) < 0.05
    fleet = make_fleet("dynamo", 3, router_temperature=1.0, rng=Random(0))
    routed = [fleet.route(req(f"r{i}", chain((10 + i, 4))), 0.0) for i in range(60)]
    assert len({d.backend for d in routed if d is not None}) == 3  # equal costs: uniform


def test_busy_workers_are_not_candidates_and_all_busy_is_a_refusal() -> None:
    # capacity 40 blocks: busy above 20 active blocks
    fleet = make_fleet("dynamo", 2, capacity=40, active_decode_blocks_threshold=0.5)
    first, ticket = serve(fleet, req("a", group(1, 0)))
    fleet.finish(ticket, 1.0, True)
    holder = first.backend
    other = url(1) if holder == url(0) else url(0)
    decoding_on(fleet, holder, 1, blocks=21)  # 21 > 0.5 x 40
    d = fleet.route(req("b", group(1, 1)), 1.0)
    assert d is not None and d.backend == other and holder not in d.ranked
    decoding_on(fleet, other, 1, blocks=21)
    assert fleet.route(req("c", group(1, 2)), 1.0) is None
    # prefill tokens in flight over the threshold: out too
    fleet = make_fleet("dynamo", 2, active_prefill_tokens_threshold=100)
    queued = fleet.dispatch(Decision(url(0), Reason.COLD, 0, (url(0),)), req("q", group(3, 0)), 0)
    for i in range(3):
        assert fleet.route(req(f"n{i}", group(3, 1 + i)), 0.0).backend == url(1)  # type: ignore[union-attr]
    fleet.on_first_token(queued, 0.1)
    fleet.check_invariants()


def test_the_approximate_indexer_forgets_a_prefix_ttl_seconds_after_its_last_request() -> None:
    fleet = make_fleet("dynamo", 2, router_ttl_secs=120.0)
    for now, reason in ((0.0, Reason.COLD), (100.0, Reason.PREFIX), (200.0, Reason.PREFIX)):
        d, ticket = serve(fleet, req(f"a{now}", group(1, int(now))), now=now)
        assert d.reason is reason
        fleet.finish(ticket, now + 1, True)
    d, _ = serve(fleet, req("late", group(1, 999)), now=321.0)  # 200 + 120 < 321: forgotten
    assert d.reason is Reason.COLD
    fleet.policy.predicted.check_invariants()  # type: ignore[attr-defined]


def test_past_the_size_cap_the_soonest_to_expire_are_pruned_tails_first() -> None:
    fleet = make_fleet("dynamo", 1, router_max_tree_size=20, router_prune_target_ratio=0.5)
    predicted = fleet.policy.predicted  # type: ignore[attr-defined]
    a, b, c = chain((1, 10)), chain((2, 10)), chain((3, 10))
    for i, blocks in enumerate((a, b)):
        serve(fleet, req(f"r{i}", blocks), now=float(i))
    assert predicted.size == 20
    serve(fleet, req("c", c), now=2.0)  # 30 > 20: down to 10, a and b go (a first)
    predicted.check_invariants()
    assert predicted.size == 10
    assert predicted.matched(url(0), c) == 10 and predicted.matched(url(0), b) == 0
    fleet2 = make_fleet("dynamo", 1, router_max_tree_size=20, router_prune_target_ratio=0.75)
    p2 = fleet2.policy.predicted  # type: ignore[attr-defined]
    for i, blocks in enumerate((a, b, c)):
        serve(fleet2, req(f"r{i}", blocks), now=float(i))
    # 15 left: all of c, and b's first 5 blocks (its tail went first)
    assert p2.matched(url(0), b) == 5 and p2.matched(url(0), c) == 10


def test_exact_mode_reads_the_engines_kv_events_and_keeps_no_record_of_its_own() -> None:
    fleet = ex.exact_fleet(2, policy="dynamo", rng=Random(0))
    for u in (ex.url(0), ex.url(1)):
        ex.sync(fleet, u)
    ids = ex.tokens((7, 6), (8, 1))
    # the engine behind e1 already holds the prompt's first 6 blocks (no request of ours)
    fleet.apply_kv_batch(ex.url(1), 1, 1.0, [ex.stored(ex.tokens((7, 6)))], 1.0)
    d = fleet.route(ex.request("a", ids), 1.0)
    assert d is not None and (d.backend, d.reason) == (ex.url(1), Reason.PREFIX)
    assert fleet.policy.predicted.size == 0  # type: ignore[attr-defined]


class _ScanIndexer:
    """The approximate indexer as a plain scan over the workers: the reference."""

    def __init__(self, ttl_s: float, max_blocks: int, prune_ratio: float) -> None:
        self.ttl_s, self.max_blocks, self.prune_ratio = ttl_s, max_blocks, prune_ratio
        self.url_to_keys: dict[str, OrderedDict[int, float]] = {}
        self.size = 0

    def expire(self, now: float) -> None:
        for keys in self.url_to_keys.values():
            while keys and next(iter(keys.values())) <= now:
                keys.popitem(last=False)
                self.size -= 1

    def insert(self, url: str, hashes: list[int], now: float) -> None:
        keys = self.url_to_keys.setdefault(url, OrderedDict())
        for h in reversed(hashes):
            if h in keys:
                keys.move_to_end(h)
            else:
                self.size += 1
            keys[h] = now + self.ttl_s
        target = int(self.max_blocks * self.prune_ratio)
        if self.size > self.max_blocks:
            while self.size > target:
                u = min((u for u, k in self.url_to_keys.items() if k),
                        key=lambda u: next(iter(self.url_to_keys[u].values())))  # fmt: skip
                self.url_to_keys[u].popitem(last=False)
                self.size -= 1


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(1, 6), st.integers(0, 3)),
        max_size=60,
    ),
    max_blocks=st.integers(3, 30),
    ratio=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
)
def test_the_heap_of_fronts_expires_and_prunes_exactly_as_a_scan(
    ops: list[tuple[int, int, int, int]], max_blocks: int, ratio: float
) -> None:
    fast = PredictedBlocks(10.0, max_blocks, ratio)
    scan = _ScanIndexer(10.0, max_blocks, ratio)
    now = 0.0
    for worker, prefix, length, step in ops:
        now += step * 2.5  # equal expiries on several workers happen (ties by worker order)
        fast.expire(now)
        scan.expire(now)
        blocks = chain((prefix, length))
        fast.insert(f"w{worker}", blocks, now)
        scan.insert(f"w{worker}", blocks, now)
        assert fast.size == scan.size
        assert {u: list(k.items()) for u, k in fast.url_to_keys.items()} == {
            u: list(k.items()) for u, k in scan.url_to_keys.items()
        }
        fast.check_invariants()
        for w in range(5):  # the binary search finds what a walk from the root finds
            for p in range(6):
                walk = 0
                for h in chain((p, 6)):
                    if h not in scan.url_to_keys.get(f"w{w}", {}):
                        break
                    walk += 1
                assert fast.matched(f"w{w}", chain((p, 6))) == walk
