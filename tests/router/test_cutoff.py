"""cutoff_at: asyncio.timeout_at's behaviour on one shared timer per loop."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.cutoff import _TABLES, cutoff_at
from tests.conftest import until


async def forever() -> None:
    """Work that never ends by itself: only a cancellation stops it."""
    await asyncio.Event().wait()


async def test_a_block_past_its_deadline_raises_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with cutoff_at(start + 0.05):
            await forever()
    assert loop.time() - start >= 0.05  # not before its deadline
    assert not _TABLES[loop].cutoffs  # nothing left behind


async def test_a_block_that_ends_in_time_is_untouched_and_the_task_goes_on() -> None:
    loop = asyncio.get_running_loop()
    async with cutoff_at(loop.time() + 5):
        await asyncio.sleep(0)
    assert not _TABLES[loop].cutoffs
    await until(lambda: not _TABLES[loop].ticking)  # the tick stopped: nothing can cancel now
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def waits() -> None:
        async with cutoff_at(loop.time() + 5):
            entered.set()
            await forever()

    task = asyncio.create_task(waits())
    await entered.wait()
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _TABLES[loop].cutoffs


async def test_a_deadline_already_past_fires_at_the_next_tick() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with cutoff_at(loop.time() - 1):
            await forever()


async def test_many_blocks_share_the_table_and_each_gets_its_own_outcome() -> None:
    loop = asyncio.get_running_loop()

    async def one(deadline_s: float, ends: bool) -> str:
        try:
            async with cutoff_at(loop.time() + deadline_s):
                await (asyncio.sleep(0) if ends else forever())
        except TimeoutError:
            return "timeout"
        return "done"

    results = await asyncio.gather(
        *(one(0.05, False) if k % 2 else one(10, True) for k in range(20))
    )
    assert results == ["done", "timeout"] * 10
