"""The KV event subscriber against real publishers: the simulator's engines and a bare
``KvEventPublisher`` (map form, byte hashes, dropped batches)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import aiohttp
import pytest

import kvroute.sim.kv_publisher as kv_publisher
from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved, encode_batch
from kvroute.common.tokenizer import default_tokenizer
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.sim.kv_publisher import KvEventPublisher
from kvroute.sim.server import SimBackend, SimFleet, start_fleet
from tests.conftest import until
from tests.exact.helpers import BS, engine_hashes, router_keys, stored, tokens

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]


def prompt(tag: str, num_words: int) -> str:
    return tag + " " + " ".join(f"{WORDS[i % 7]}{i % 5}" for i in range(num_words))


def exact_router(urls: list[str], block_size: int = 16) -> Fleet:
    config = FleetConfig(default_block_size=block_size, mode="exact")
    fleet = Fleet(make_policy("prefix"), config)
    for u in urls:
        fleet.add_backend(u)
    return fleet


@pytest.fixture
async def sims() -> AsyncIterator[SimFleet]:
    f = await start_fleet(2, profile="tiny", speedup=4.0, kv_events=True, kv_replay=True)
    try:
        yield f
    finally:
        await f.close()


def subscriber_of(fleet: Fleet, sims: SimFleet) -> KvEventSubscriber:
    """A subscriber to every engine of ``sims``, with their replay sockets."""
    return KvEventSubscriber(
        fleet,
        dict(zip(sims.urls, sims.kv_endpoints, strict=True)),
        {b.url: b.publisher.replay_endpoint for b in sims.backends},
    )


async def send(session: aiohttp.ClientSession, backend: SimBackend, body: dict) -> None:
    async with session.post(backend.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def caught_up(sub: KvEventSubscriber, backend: SimBackend) -> bool:
    status = sub.status(backend.url)
    assert backend.publisher is not None
    published = backend.publisher._seq - 1  # the last batch number it sent
    return (
        status is not None
        and not backend.engine.has_unfinished_requests()
        and (status.last_seq if status.last_seq is not None else -1) == published
    )


def assert_view_matches_engine(fleet: Fleet, backend: SimBackend, prompts: list[str]) -> None:
    """The router's view of ``backend`` is the engine's own cached block set, in router keys;
    and every prompt's router keys match as deep as the engine's own lookup would."""
    model = fleet.sync.model(backend.url)
    assert model is not None, "backend is not in exact mode"
    engine_blocks = set(backend.engine.block_manager._hash_to_block)
    assert model.confirmed_keys() == {model.key_of(h) for h in engine_blocks}
    assert None not in {model.key_of(h) for h in engine_blocks}
    assert set(model.blocks()) <= model.confirmed_keys() and model.num_speculative == 0
    for text in prompts:
        ids = default_tokenizer().encode(text)
        keys = token_block_hashes(ids, 16)
        engine_hit = 0
        for h in keys:  # the simulator's own hashes for an unsalted prompt
            if h not in engine_blocks:
                break
            engine_hit += 1
        assert fleet.index.matched_blocks(backend.url, keys) == engine_hit


async def test_view_equals_engine_block_sets_under_eviction_and_salts(sims, session):
    fleet = exact_router(sims.urls)
    sub = subscriber_of(fleet, sims)
    await sub.start()
    try:
        await until(lambda: all(fleet.is_exact(u) for u in sims.urls))  # empty history
        sent: list[str] = []
        for k in range(28):  # ~11k prompt tokens per backend: more than its 8,192 KV slots
            text = prompt(f"sys{k % 3}", 120) + f" question {k} " + prompt(f"q{k}", 250)
            body: dict[str, object] = {"prompt": text, "max_tokens": 2}
            if k % 5 == 0:
                # A salted prompt's engine hashes differ from the router's keys. Router
                # keys ignore salts (a known limit), so it shares no prefix with the rest.
                body = {"prompt": f"own{k} {text}", "max_tokens": 2, "cache_salt": f"s{k}"}
            else:
                sent.append(text)
            await send(session, sims.backends[k % 2], body)
        for b in sims.backends:
            await until(lambda b=b: caught_up(sub, b))
            assert_view_matches_engine(fleet, b, sent)
            status = sub.status(b.url)
            assert status.mode == "exact" and status.num_gaps == 0 and status.num_events > 0
            assert fleet.sync.model(b.url).num_removed > 0  # the engine evicted
        fleet.check_invariants()
    finally:
        await sub.stop()


async def test_a_late_router_rebuilds_the_view_by_replay(sims, session):
    texts = [prompt(f"late{k}", 150) for k in range(4)]
    for k, text in enumerate(texts):
        await send(session, sims.backends[k % 2], {"prompt": text, "max_tokens": 1})
    fleet = exact_router(sims.urls)
    sub = subscriber_of(fleet, sims)
    await sub.start()
    try:
        for b in sims.backends:
            await until(lambda b=b: caught_up(sub, b) and fleet.is_exact(b.url))
            assert_view_matches_engine(fleet, b, texts)
            assert fleet.index.num_blocks(b.url) > 0
    finally:
        await sub.stop()


async def test_without_replay_a_late_router_waits_for_a_reset(session):
    sims = await start_fleet(1, profile="tiny", speedup=4.0, kv_events=True)
    backend = sims.backends[0]
    try:
        await send(session, backend, {"prompt": prompt("before", 100), "max_tokens": 1})
        fleet = exact_router(sims.urls)
        sub = KvEventSubscriber(fleet, {backend.url: backend.kv_endpoint})
        await sub.start()
        try:
            for k in range(50):  # until the SUB has joined and seen a batch
                await send(session, backend, {"prompt": prompt(f"x{k}", 40), "max_tokens": 1})
                if fleet.kv_next_seq(backend.url):
                    break
            await until(lambda: caught_up(sub, backend))
            assert not fleet.is_exact(backend.url)  # history unknown: approximate
            async with session.post(backend.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            await until(lambda: fleet.is_exact(backend.url))
            after = [prompt("after", 100)]
            await send(session, backend, {"prompt": after[0], "max_tokens": 1})
            await until(lambda: caught_up(sub, backend))
            assert_view_matches_engine(fleet, backend, after)
        finally:
            await sub.stop()
    finally:
        await sims.close()


@pytest.fixture
async def publisher() -> AsyncIterator[KvEventPublisher]:
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub.start()
    try:
        yield pub
    finally:
        await pub.close()


def drop_next_batch(pub: KvEventPublisher) -> None:
    """Lose the next batch on the wire (it still reaches the replay buffer)."""
    real = pub._pub

    class Lossy:
        def send_multipart(self, *args: object, **kwargs: object) -> None:
            pub._pub = real

    pub._pub = Lossy()  # type: ignore[assignment]


@pytest.mark.parametrize("form", ["array", "map"])
async def test_gap_is_filled_by_replay_in_both_forms_with_byte_hashes(publisher, monkeypatch, form):
    monkeypatch.setattr(kv_publisher, "encode_batch", functools.partial(encode_batch, form=form))
    url = "http://engine:8000"
    fleet = exact_router([url], block_size=BS)
    sub = KvEventSubscriber(fleet, {url: publisher.endpoint}, {url: publisher.replay_endpoint})
    await sub.start()
    try:
        await until(lambda: fleet.is_exact(url))
        a, b = tokens((1, 3)), tokens((2, 2))
        h = engine_hashes(a)
        big = [x.to_bytes(32, "big") for x in h]
        first = stored(a)
        publisher.publish([type(first)(big, None, first.token_ids, BS)])  # type: ignore[arg-type]
        drop_next_batch(publisher)
        publisher.publish([stored(b)])  # lost live, kept for replay
        publisher.publish([BlockRemoved([big[2]])])  # type: ignore[list-item]
        await until(lambda: (sub.status(url).last_seq or -1) == 2)
        assert fleet.index.matched_blocks(url, router_keys(a)) == 2
        assert fleet.index.matched_blocks(url, router_keys(b)) == 2
        status = sub.status(url)
        assert status.mode == "exact" and status.num_replays >= 2
        fleet.check_invariants()
    finally:
        await sub.stop()


async def test_gap_without_replay_falls_back_until_all_blocks_cleared():
    pub = KvEventPublisher("tcp://127.0.0.1:0")
    url = "http://engine:8000"
    fleet = exact_router([url], block_size=BS)
    sub = KvEventSubscriber(fleet, {url: pub.endpoint})
    await sub.start()
    try:
        for _ in range(200):  # until the SUB has joined
            pub.publish([AllBlocksCleared()])
            await asyncio.sleep(0.01)
            if fleet.is_exact(url):
                break
        gaps = sub.status(url).num_gaps  # 1 if the SUB joined after the first probe
        a = tokens((1, 2))
        pub.publish([stored(a)])
        drop_next_batch(pub)
        pub.publish([stored(tokens((3, 2)))])
        pub.publish([stored(tokens((4, 2)))])
        await until(lambda: not fleet.is_exact(url))
        assert sub.status(url).num_gaps == gaps + 1
        assert fleet.index.matched_blocks(url, router_keys(a)) == 2  # warm fallback
        pub.publish([AllBlocksCleared(), stored(tokens((5, 1)))])
        await until(lambda: fleet.is_exact(url))
        assert fleet.index.matched_blocks(url, router_keys(a)) == 0
        assert fleet.index.matched_blocks(url, router_keys(tokens((5, 1)))) == 1
    finally:
        await sub.stop()
        await pub.close()


async def test_add_and_remove_backends_while_running(publisher):
    url = "http://engine:8000"
    fleet = exact_router([url], block_size=BS)
    sub = KvEventSubscriber(fleet)
    await sub.start()
    try:
        sub.add_backend(url, publisher.endpoint, publisher.replay_endpoint)
        await until(lambda: fleet.is_exact(url))
        assert sub.status(url).running
        sub.remove_backend(url)
        assert sub.status(url) is None and sub.urls() == []
    finally:
        await sub.stop()
