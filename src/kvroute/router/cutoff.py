"""Deadlines on the request path, checked by one timer per event loop.

``asyncio.timeout_at`` arms a loop timer for every use (about 7 us with its bookkeeping
on Python 3.11, and a request takes two). The request path's deadlines are seconds long
and need no better than ``TICK_S``: ``cutoff_at`` puts the awaiting task in a table, and
one callback, running every ``TICK_S`` while the table is not empty, cancels the tasks
whose deadline passed. Entering and leaving cost two dict operations.

It behaves as ``asyncio.timeout_at`` (up to ``TICK_S`` late): at the deadline the task is
cancelled and the ``async with`` raises TimeoutError, unless the task was also cancelled
for another reason (the client went away), which then propagates as CancelledError.
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType

TICK_S = 0.02  # how late a deadline may fire


class _Table:
    """The cutoffs of one event loop and the tick that checks them."""

    __slots__ = ("__weakref__", "cutoffs", "loop", "ticking")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.cutoffs: dict[int, Cutoff] = {}
        self.ticking = False

    def add(self, cutoff: Cutoff) -> None:
        self.cutoffs[id(cutoff)] = cutoff
        if not self.ticking:
            self.ticking = True
            self.loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        due = [c for c in self.cutoffs.values() if c.at <= now]
        for cutoff in due:
            del self.cutoffs[id(cutoff)]
            cutoff.expire()
        self.ticking = bool(self.cutoffs)
        if self.ticking:
            self.loop.call_later(TICK_S, self._tick)


_TABLES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Table] = weakref.WeakKeyDictionary()


class Cutoff:
    """``async with cutoff_at(at)``: see the module docstring."""

    __slots__ = ("_cancelling", "_expired", "_table", "_task", "at")

    def __init__(self, at: float) -> None:
        self.at = at
        self._expired = False

    async def __aenter__(self) -> Cutoff:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("cutoff_at must be used inside a task")
        loop = asyncio.get_running_loop()
        table = _TABLES.get(loop)
        if table is None:
            table = _TABLES[loop] = _Table(loop)
        self._task, self._table = task, table
        self._cancelling = task.cancelling()
        table.add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._table.cutoffs.pop(id(self), None)
        # expired: take our cancellation back; if it was the only one, it is the timeout
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()


def cutoff_at(at: float) -> Cutoff:
    """A deadline at loop time ``at`` for the ``async with`` block."""
    return Cutoff(at)
