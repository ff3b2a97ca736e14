"""Fixtures: simulated fleets on free loopback ports, and a client session."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from kvroute.sim.server import SimFleet, start_fleet
from tests.conftest import until


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    """Two `tiny` backends with KV events; checks at teardown that nothing is left running."""
    f = await start_fleet(2, profile="tiny", speedup=4.0, kv_events=True)
    try:
        yield f
        for backend in f.backends:  # every request finished or was aborted
            with contextlib.suppress(AssertionError):
                await until(lambda b=backend: not b.engine.has_unfinished_requests())
            assert not backend.engine.has_unfinished_requests(), "a request leaked"
            assert backend.engine.stats.kv_cache_usage == 0, "blocks leaked"
    finally:
        await f.close()
