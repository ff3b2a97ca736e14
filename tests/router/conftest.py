"""Router test harness: fake backends, routers on loopback, and a leak check at teardown.

At teardown every router's Fleet must have released every load count (requests, queued
prefill and in-flight tokens back to zero, invariants hold), no client key may hold a
slot, and no asyncio task may be left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvroute.bench.fake_backend import FakeBackend
from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, HealthConfig, LimitConfig, RouterConfig
from kvroute.router.state import STATE, RouterState
from tests.conftest import until


class FakeClock:
    """Monotonic seconds moved by hand (breakers, rate limits)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def router_config(urls: list[str], **changes: Any) -> RouterConfig:
    """A RouterConfig for tests: round-robin, no background scraping, no retry backoff."""
    base = RouterConfig(
        backends=tuple(BackendConfig(url=u) for u in urls),
        policy="round_robin",
        health=HealthConfig(interval_s=3600, timeout_s=1.0, scrape_interval_s=0),
        limits=LimitConfig(retry_backoff_s=0.0),
    )
    return dataclasses.replace(base, **changes)


class Harness:
    def __init__(self) -> None:
        self.backends: list[FakeBackend] = []
        self.clients: list[TestClient[Any, Any]] = []

    async def backend(self, name: str = "b", model: str = "m1") -> FakeBackend:
        b = await FakeBackend(name, model).start()
        self.backends.append(b)
        return b

    async def router(
        self, urls: list[str], *, clock: Any = None, **changes: Any
    ) -> TestClient[Any, Any]:
        config = router_config(urls, **changes)
        app = make_app(config, clock=clock) if clock is not None else make_app(config)
        server = TestServer(app, host="127.0.0.1")
        # as the router's own listeners (router/listener.py): bodies inflate in body.py
        await server.start_server(auto_decompress=False)
        client = TestClient(server)
        await client.start_server()
        self.clients.append(client)
        return client

    @staticmethod
    def state(client: TestClient[Any, Any]) -> RouterState:
        return client.app[STATE]  # type: ignore[index]

    async def settle(self) -> None:
        """Let handlers that are finishing (cancelled streams) run their finally blocks
        (up to 5 s; what is still counted then is the caller's assertion to report)."""
        with contextlib.suppress(AssertionError):
            await until(lambda: all(self.state(c).num_in_flight == 0 for c in self.clients), 5.0)


def assert_no_load(state: RouterState) -> None:
    state.fleet.check_invariants()
    for bs in state.fleet.backend_states():
        assert bs.in_flight_requests == 0, f"{bs.url}: requests still counted"
        assert bs.in_flight_tokens == 0, f"{bs.url}: tokens still counted"
        assert bs.queued_prefill_tokens == 0, f"{bs.url}: prefill still counted"
    assert state.num_in_flight == 0
    assert all(k.in_flight == 0 for k in state.gate.states())


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.settle()
    for client in h.clients:
        assert_no_load(h.state(client))
        await client.close()
    for b in h.backends:
        await b.close()
    await asyncio.sleep(0)
    current = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not pending, f"tasks left pending: {pending}"


Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Answer], Awaitable[tuple[str, list[Any]]]]]:
    """Starts a loopback engine whose completions answer is ``answer``; returns its URL
    and the list of the headers each completion request came with."""
    servers: list[TestServer] = []

    async def start(answer: Answer) -> tuple[str, list[Any]]:
        seen: list[Any] = []

        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            seen.append(request.headers.copy())
            return await answer(request)

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m1"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", models)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), seen

    yield start
    for s in servers:
        await s.close()
