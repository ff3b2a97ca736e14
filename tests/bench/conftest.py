"""Fixtures: the fake OpenAI server, in the test's loop or in a thread (for the CLI)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from kvroute.bench.fake_backend import FakeState, make_fake_app, router_like_state


async def _start(state: FakeState) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_fake_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def fake() -> AsyncIterator[tuple[str, FakeState]]:
    state = router_like_state()
    runner, url = await _start(state)
    yield url, state
    await runner.cleanup()


@pytest.fixture
def fake_in_thread() -> Iterator[tuple[str, FakeState]]:
    """The fake server on its own loop in a thread, for code that calls asyncio.run."""
    state, loop = router_like_state(), asyncio.new_event_loop()
    ready, box = threading.Event(), {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(_start(state))
        ready.set()
        loop.run_forever()
        loop.run_until_complete(box["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    yield box["url"], state
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
