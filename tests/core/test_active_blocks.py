"""ActiveBlocks: the distinct blocks of a backend's requests in flight (core/load.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.common.hashing import token_block_hashes
from kvroute.core.load import ActiveBlocks

from .routing_helpers import chain, make_fleet, req, serve, url


def _chains(draw_tokens: list[list[int]]) -> list[list[int]]:
    return [token_block_hashes(tokens, 1) for tokens in draw_tokens]


# prompts over a 2-letter alphabet of 1-token blocks: short chains that share prefixes often
prompts = st.lists(st.lists(st.integers(0, 1), min_size=0, max_size=6), min_size=1, max_size=8)


@given(prompts, st.data())
def test_it_holds_the_union_of_the_open_chains_in_any_order(tokens, data) -> None:
    chains = _chains(tokens)
    active, open_ = ActiveBlocks(), []
    for i in data.draw(st.permutations(list(range(len(chains))) * 2)):
        if i in open_:
            active.remove(chains[i])
            open_.remove(i)
        else:
            probe = chains[(i + 1) % len(chains)]
            union = {k for j in open_ for k in chains[j]}
            assert active.num_new(probe) == sum(k not in union for k in probe)
            active.add(chains[i])
            open_.append(i)
        assert set(active.key_to_count) == {k for j in open_ for k in chains[j]}
        for n, j in enumerate(open_):  # what each one's end would free
            others = {k for m in open_[:n] + open_[n + 1 :] for k in chains[m]}
            assert active.num_own(chains[j]) == sum(k not in others for k in chains[j])
    for i in list(open_):
        active.remove(chains[i])
    assert len(active) == 0


def test_the_same_chain_twice_counts_once_and_stays_while_either_runs() -> None:
    a, b = chain((7, 4)), chain((7, 4), (8, 2))  # b extends a
    active = ActiveBlocks()
    active.add(a)
    active.add(b)
    active.add(a)
    assert len(active) == 6
    active.remove(b)
    assert len(active) == 4 and active.num_new(b) == 2
    active.remove(a)
    assert len(active) == 4  # the other copy of a still runs
    active.remove(a)
    assert len(active) == 0


def test_a_backend_whose_running_requests_fill_its_kv_makes_a_cold_one_wait() -> None:
    """The cost model counts the KV our requests in flight pin (their distinct blocks and
    outputs) the moment they are sent, before any scrape: three long requests running on
    backend 0 fill its cache, so a cold fourth would wait there for two of them to end
    (a lifetime after their first tokens, just now) and goes to the idle backend."""
    fleet = make_fleet("prefix", 2, capacity=64)  # 1,024 tokens a backend
    _, t = serve(fleet, req("warm", chain((5, 2)), max_tokens=8), exclude=[url(1)])
    fleet.on_first_token(t, 0.1)
    fleet.finish(t, 6.1, ok=True)  # a request keeps its KV about 6 s
    cold = req("cold", chain((99, 18)), max_tokens=64)
    idle = fleet.route(cold, 7.0, exclude=[url(1)])
    assert idle is not None and idle.ttft_estimate_s is not None
    for i in range(3):
        _, t = serve(fleet, req(f"r{i}", chain((10 + i, 18)), max_tokens=64), 7.0, exclude=[url(1)])
        fleet.on_first_token(t, 7.0)  # prefilled: nothing left in its queue
    busy = fleet.route(cold, 7.0, exclude=[url(1)])
    assert busy is not None and busy.ttft_estimate_s is not None
    assert busy.ttft_estimate_s - idle.ttft_estimate_s >= 6.0
    free_choice = fleet.route(cold, 7.0)
    assert free_choice is not None and free_choice.backend == url(1)


@given(prompts, st.integers(2, 5))
def test_with_a_stride_it_counts_the_union_to_within_the_stride_per_chain(tokens, stride) -> None:
    chains = [c for c in _chains(tokens) if c]
    active = ActiveBlocks(stride)
    for c in chains:
        active.add(c)
    union = {k for c in chains for k in c}
    assert abs(active.num_blocks - len(union)) < stride * max(1, len(chains))
    probe = chains[0] if chains else []
    assert active.num_new(probe) == 0
    for n, c in enumerate(chains):
        others = {k for m, o in enumerate(chains) if m != n for k in o}
        assert abs(active.num_own(c) - sum(k not in others for k in c)) < stride
    for c in chains:
        active.remove(c)
    assert active.num_blocks == 0


def test_a_hit_nobody_pins_needs_free_kv_and_a_hit_on_a_running_prefix_does_not() -> None:
    """The engine admits a request only when its new blocks and the cached blocks no
    running request holds (taken back from the free pool) fit: a backend whose running
    requests fill its KV makes even a cached prompt wait, unless a running request pins
    that very prefix (vLLM's block manager; engine/block_manager.allocate). Chains are
    multiples of the policy's stride (8), so the counts are exact."""
    fleet = make_fleet("prefix", 2, capacity=64)  # 1,024 tokens a backend
    _, t = serve(fleet, req("warm", chain((5, 2)), max_tokens=8), exclude=[url(1)])
    fleet.on_first_token(t, 0.1)
    fleet.finish(t, 6.1, ok=True)  # a request keeps its KV about 6 s
    doc = chain((7, 16))  # 256 tokens, cached on backend 0 and idle
    _, t = serve(fleet, req("doc", doc, max_tokens=8), 6.5, exclude=[url(1)])
    fleet.on_first_token(t, 6.6)
    fleet.finish(t, 6.7, ok=True)
    again = req("again", doc + chain((8, 8)), max_tokens=8)  # needs 128 new + 256 revived
    fits = fleet.route(again, 7.0, exclude=[url(1)])
    assert fits is not None and fits.ttft_estimate_s is not None

    def run(name: str, blocks: list[int]):
        _, t = serve(fleet, req(name, blocks, max_tokens=8), 7.0, exclude=[url(1)])
        fleet.on_first_token(t, 7.0)
        return t

    # 24 + 16 blocks and two outputs pinned: 368 tokens free, short of 392
    running = [run("r0", chain((10, 24))), run("r1", chain((11, 16)))]
    full = fleet.route(again, 7.0, exclude=[url(1)])
    assert full is not None and full.reason == "prefix" and full.ttft_estimate_s is not None
    assert full.ttft_estimate_s - fits.ttft_estimate_s >= 4.0  # waits for one to end
    for t in running:
        fleet.finish(t, 7.0, ok=True)
    # the same pressure, but one of the running requests extends the prefix: it is pinned
    run("pin", doc + chain((9, 8)))
    run("s0", chain((20, 16)))
    pinned = fleet.route(again, 7.0, exclude=[url(1)])
    assert pinned is not None and pinned.ttft_estimate_s is not None
    assert pinned.ttft_estimate_s < fits.ttft_estimate_s + 0.5


def test_a_stale_kv_gauge_does_not_outlive_our_requests_it_counted() -> None:
    """A scrape counts the KV of the requests running then. Once ours among them end the
    router knows that KV is free again, before the next scrape; the part of the gauge
    that requests we did not send explain stays counted."""
    fleet = make_fleet("prefix", 2, capacity=64)
    _, t = serve(fleet, req("warm", chain((5, 2)), max_tokens=8), exclude=[url(1)])
    fleet.on_first_token(t, 0.1)
    fleet.finish(t, 6.1, ok=True)
    cold = req("cold", chain((99, 40)), max_tokens=8)  # 640 tokens
    idle = fleet.route(cold, 7.0, exclude=[url(1)])
    assert idle is not None and idle.ttft_estimate_s is not None
    ours = []
    for i in range(3):
        _, t = serve(fleet, req(f"r{i}", chain((10 + i, 16)), max_tokens=8), 7.0, exclude=[url(1)])
        fleet.on_first_token(t, 7.0)
        ours.append(t)
    fleet.update_engine_stats(url(0), num_running=3, num_waiting=0, kv_cache_usage=0.8)
    for t in ours:
        fleet.finish(t, 7.5, ok=True)
    after = fleet.route(cold, 7.5, exclude=[url(1)])
    assert after is not None and after.ttft_estimate_s is not None
    assert after.ttft_estimate_s < idle.ttft_estimate_s + 0.1  # no wait (evictions differ)
    # the same gauge, but two of the three running requests were not ours
    _, t = serve(fleet, req("mine", chain((30, 16)), max_tokens=8), 8.0, exclude=[url(1)])
    fleet.update_engine_stats(url(0), num_running=3, num_waiting=0, kv_cache_usage=0.8)
    fleet.finish(t, 8.1, ok=True)
    shared = fleet.route(cold, 8.1, exclude=[url(1)])
    assert shared is not None and shared.ttft_estimate_s is not None
    assert shared.ttft_estimate_s - idle.ttft_estimate_s >= 1.0  # waits for a stranger
