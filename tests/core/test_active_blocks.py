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
    for c in chains:
        active.remove(c)
    assert active.num_blocks == 0
