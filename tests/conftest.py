"""Fixtures and helpers shared by every test package."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from kvroute.sim.server import SimFleet, start_fleet


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``cond`` every 10 ms until it holds; AssertionError after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


@pytest.fixture
async def kv_sims() -> AsyncIterator[SimFleet]:
    """Two tiny simulated engines publishing KV events (with replay), 50x real time."""
    fleet = await start_fleet(2, profile="tiny", speedup=50.0, kv_events=True, kv_replay=True)
    try:
        yield fleet
    finally:
        await fleet.close()
