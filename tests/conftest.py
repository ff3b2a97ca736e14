"""Fixtures and helpers shared by every test package."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest


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
