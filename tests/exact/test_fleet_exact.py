"""Fleet in exact mode: event streams, fallbacks, speculation, key kinds, status fields."""

from __future__ import annotations

import pytest

from kvroute.common.hashing import chain_seed, token_block_hashes
from kvroute.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from kvroute.core.config import FleetConfig
from kvroute.core.kv_sync import KvOutcome
from tests.exact.helpers import (
    BS,
    engine_hashes,
    exact_fleet,
    matched,
    request,
    router_keys,
    stored,
    sync,
    tokens,
    url,
)

A = url(0)
B = url(1)


def test_mode_is_validated():
    with pytest.raises(ValueError, match=r"fleet\.mode"):
        FleetConfig(mode="precise")
    with pytest.raises(ValueError, match="speculative_ttl_s"):
        FleetConfig(speculative_ttl_s=-1)


def test_first_batch_syncs_and_events_fill_the_index():
    fleet = exact_fleet()
    ids = tokens((1, 3))
    assert not fleet.is_exact(A)
    assert fleet.apply_kv_batch(A, 0, 1.0, [stored(ids)], 0.0) is KvOutcome.APPLIED
    assert fleet.is_exact(A) and matched(fleet, A, ids) == 3
    assert fleet.index.holders(router_keys(ids)[0]) == {A}
    fleet.apply_kv_batch(A, 1, 2.0, [BlockRemoved(engine_hashes(ids)[2:])], 0.0)
    assert matched(fleet, A, ids) == 2
    fleet.check_invariants()


@pytest.mark.parametrize("form", ["array", "map"])
def test_both_wire_forms_and_byte_hashes_map_to_the_same_keys(form):
    fleet = exact_fleet()
    ids = tokens((4, 2))
    h = engine_hashes(ids)
    as_bytes = [x.to_bytes(32, "big") for x in h]  # 32-byte hashes, last 8 bytes = the int
    event = BlockStored(as_bytes, None, ids, BS)  # type: ignore[arg-type]
    ts, events = decode_batch(encode_batch(5.0, [event], form=form))
    fleet.apply_kv_batch(A, 0, ts, events, 0.0)
    assert matched(fleet, A, ids) == 2
    payload = encode_batch(6.0, [BlockRemoved([as_bytes[1]])], form=form)  # type: ignore[list-item]
    fleet.apply_kv_batch(A, 1, *decode_batch(payload), 0.0)
    assert matched(fleet, A, ids) == 1
    fleet.check_invariants()


def test_gap_is_reported_then_filled_by_replay():
    fleet = exact_fleet()
    a, b = tokens((1, 2)), tokens((2, 2))
    sync(fleet, A)
    assert fleet.apply_kv_batch(A, 2, 3.0, [stored(b)], 0.0) is KvOutcome.GAP
    assert fleet.kv_next_seq(A) == 1 and fleet.is_exact(A)
    fleet.apply_kv_batch(A, 1, 2.0, [stored(a)], 0.0)  # the replayed batch
    assert fleet.apply_kv_batch(A, 2, 3.0, [stored(b)], 0.0) is KvOutcome.APPLIED
    assert fleet.apply_kv_batch(A, 2, 3.0, [stored(b)], 0.0) is KvOutcome.DUPLICATE
    assert matched(fleet, A, a) == 2 and matched(fleet, A, b) == 2
    state = fleet.backend_states()[0]
    assert (state.mode, state.kv_num_gaps, state.kv_last_seq) == ("exact", 1, 2)


def test_unfilled_gap_falls_back_to_a_warm_approximate_model_until_a_reset():
    fleet = exact_fleet()
    a, b = tokens((1, 2)), tokens((2, 2))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(a)], 0.0)
    assert fleet.apply_kv_batch(A, 5, 6.0, [stored(b)], 0.0) is KvOutcome.GAP
    fleet.kv_gap_unfilled(A, 5)
    assert not fleet.is_exact(A)
    assert matched(fleet, A, a) == 2  # the LRU starts from the exact view
    fleet.apply_kv_batch(A, 5, 6.0, [stored(b)], 0.0)  # applied, but nobody trusts it
    assert matched(fleet, A, b) == 0
    fleet.check_invariants()
    fleet.apply_kv_batch(A, 6, 7.0, [stored(b, 0, 1), AllBlocksCleared(), stored(b)], 0.0)
    assert fleet.is_exact(A)
    assert matched(fleet, A, a) == 0 and matched(fleet, A, b) == 2
    fleet.check_invariants()


def test_all_blocks_cleared_empties_an_exact_view():
    fleet = exact_fleet()
    ids = tokens((1, 3))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(ids)], 0.0)
    fleet.apply_kv_batch(A, 1, 2.0, [AllBlocksCleared()], 0.0)
    assert fleet.is_exact(A) and matched(fleet, A, ids) == 0


def test_engine_restart_starts_clean():
    fleet = exact_fleet()
    ids = tokens((1, 3))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(ids)], 0.0)
    fleet.apply_kv_batch(A, 1, 2.0, [], 0.0)
    fresh = tokens((5, 1))
    assert fleet.apply_kv_batch(A, 0, 9.0, [stored(fresh)], 0.0) is KvOutcome.APPLIED
    assert fleet.is_exact(A)
    assert matched(fleet, A, ids) == 0 and matched(fleet, A, fresh) == 1
    fleet.apply_kv_batch(A, 1, 10.0, [], 0.0)
    fleet.apply_kv_batch(A, 2, 11.0, [], 0.0)
    # a restart seen late (seq went back, time went forward): clean, then a gap from 0
    assert fleet.apply_kv_batch(A, 1, 20.0, [], 0.0) is KvOutcome.GAP
    assert fleet.kv_next_seq(A) == 0
    assert not fleet.is_exact(A) and matched(fleet, A, fresh) == 0
    assert fleet.backend_states()[0].kv_num_restarts == 2
    fleet.check_invariants()


def test_removed_backend_starts_clean_when_added_again():
    fleet = exact_fleet()
    ids = tokens((1, 2))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(ids)], 0.0)
    fleet.remove_backend(A)
    assert fleet.apply_kv_batch(A, 1, 2.0, [], 0.0) is KvOutcome.UNKNOWN
    fleet.add_backend(A)
    assert not fleet.is_exact(A) and fleet.kv_next_seq(A) == 0
    fleet.check_invariants()


def test_empty_history_syncs_an_idle_engine():
    fleet = exact_fleet()
    fleet.kv_history_empty(A)
    assert fleet.is_exact(A)


def test_speculation_is_confirmed_by_events():
    fleet = exact_fleet(ttl=2.0)
    ids = tokens((1, 3))
    sync(fleet, A)
    sync(fleet, B)
    d = fleet.route(request("r1", ids), 0.0)
    t = fleet.dispatch(d, request("r1", ids), 0.0)
    assert matched(fleet, d.backend, ids) == 3
    assert fleet.backend_states()[[A, B].index(d.backend)].speculative_blocks == 3
    fleet.apply_kv_batch(d.backend, 1, 2.0, [stored(ids, 0, 2)], 0.5)
    fleet.finish(t, 1.0, ok=True)
    fleet.route(request("r2", tokens((9, 1))), 5.0)  # expiry runs on the request path
    assert matched(fleet, d.backend, ids) == 2  # confirmed blocks stay, the third expired
    fleet.check_invariants()


def test_speculation_expires_without_events():
    fleet = exact_fleet(n=1, ttl=2.0)
    ids = tokens((1, 3))
    sync(fleet, A)
    d = fleet.route(request("r1", ids), 0.0)
    fleet.dispatch(d, request("r1", ids), 0.0)
    fleet.route(request("x", ids), 1.9)
    assert matched(fleet, d.backend, ids) == 3
    fleet.route(request("x", ids), 2.0)
    assert matched(fleet, d.backend, ids) == 0
    fleet.check_invariants()


def test_failed_request_withdraws_its_speculation_at_once():
    fleet = exact_fleet(n=1)
    ids = tokens((1, 3))
    sync(fleet, A)
    d = fleet.route(request("r1", ids), 0.0)
    t = fleet.dispatch(d, request("r1", ids), 0.0)
    fleet.finish(t, 0.1, ok=False)
    assert matched(fleet, A, ids) == 0
    fleet.check_invariants()


def _burst(fleet, n: int = 6) -> set[str]:
    """Same-prefix requests, each sent after the previous one's first token, while the
    engines' BlockStored events have not arrived yet (publishing lags the compute)."""
    for i in range(4):
        sync(fleet, url(i))
    system = tokens((7, 64))  # a long shared prefix
    chosen = set()
    for k in range(n):
        now = 0.05 * k
        r = request(f"r{k}", system + tokens((100 + k, 1)), max_tokens=32)
        d = fleet.route(r, now)
        t = fleet.dispatch(d, r, now)
        fleet.on_first_token(t, now + 0.01)
        chosen.add(d.backend)
    fleet.check_invariants()
    return chosen


def test_same_prefix_burst_is_not_scattered_while_events_are_in_flight():
    assert len(_burst(exact_fleet(n=4))) == 1
    assert len(_burst(exact_fleet(n=4, num_hashed=0))) == 1


def test_without_speculation_the_burst_scatters():
    # Hashed homes alone also keep a cold burst together, so switch them off to see
    # what speculation does on its own.
    assert len(_burst(exact_fleet(n=4, ttl=0.0, num_hashed=0))) > 1
    assert len(_burst(exact_fleet(n=4, ttl=0.0))) == 1


def test_key_kind_per_mode():
    assert exact_fleet(mode="approximate").key_kind_for(None) == "text"
    assert exact_fleet(mode="exact").key_kind_for(None) == "tokens"
    auto = exact_fleet(mode="auto")
    assert auto.key_kind_for(None) == "text"
    sync(auto, A)
    assert auto.key_kind_for(None) == "tokens"
    auto.kv_gap_unfilled(A, 10)
    assert auto.key_kind_for(None) == "text"


def test_approximate_mode_tracks_the_stream_but_never_switches():
    fleet = exact_fleet(mode="approximate")
    ids = tokens((1, 2))
    fleet.apply_kv_batch(A, 0, 1.0, [stored(ids), AllBlocksCleared()], 0.0)
    assert not fleet.is_exact(A)
    state = fleet.backend_states()[0]
    assert (state.mode, state.kv_last_seq, state.kv_num_events) == ("approximate", 0, 2)
    fleet.check_invariants()


def test_block_size_is_learned_from_events_when_not_scraped():
    fleet = exact_fleet()
    fleet.apply_kv_batch(A, 0, 1.0, [BlockStored([1], None, [5] * 8, 8)], 0.0)
    assert fleet.backend_states()[0].block_size == 8


def test_cpu_tier_events_are_ignored():
    fleet = exact_fleet()
    ids = tokens((1, 2))
    e = stored(ids)
    cpu = BlockStored(e.block_hashes, None, e.token_ids, BS, medium="CPU")
    fleet.apply_kv_batch(A, 0, 1.0, [cpu], 0.0)
    assert matched(fleet, A, ids) == 0


def test_salted_and_adapter_blocks_are_keyed_as_their_requests_are():
    """vLLM names the salt (first block) and the LoRA adapter in a BlockStored: the view
    keys those chains from ``chain_seed(salt, adapter)``, as the proxy keys the requests."""
    fleet = exact_fleet()
    ids = tokens((1, 3))
    salted = BlockStored([91, 92, 93], None, ids, BS, extra_keys=[["t1"], None, None])
    adapter = BlockStored([81, 82, 83], None, ids, BS, lora_name="ad",
                          extra_keys=[["ad"], ["ad"], ["ad"]])  # fmt: skip
    fleet.apply_kv_batch(A, 0, 1.0, [salted, adapter], 0.0)
    for seed in (chain_seed("t1"), chain_seed(None, "ad")):
        keys = token_block_hashes(ids, BS, seed)
        assert fleet.index.holders(keys[-1]) == {A}
    assert fleet.index.holders(router_keys(ids)[0]) == set()  # no plain chain was stored
    fleet.check_invariants()
