"""open_upstream: one send per call, failures classified (refused vs request-caused)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvroute.router.upstream import AttemptFailed, Deadline, open_upstream


class _Resp:
    status = 200


class _Session:
    """Raises the queued exceptions, then answers."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        self.calls = 0

    async def post(self, url: str, **kwargs: Any) -> _Resp:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return _Resp()


def _in(seconds: float) -> Deadline:
    return Deadline(asyncio.get_running_loop().time() + seconds, seconds, "timeouts.x_s")


async def _fail(errors: list[BaseException]) -> tuple[AttemptFailed, int]:
    s = _Session(errors)
    with pytest.raises(AttemptFailed) as info:
        await open_upstream(s, "http://b/x", b"{}", {}, _in(1.0))  # type: ignore[arg-type]
    return info.value, s.calls


async def test_a_disconnect_is_not_resent_even_on_a_pooled_connection() -> None:
    """A stale keep-alive close and a body that made the backend drop the connection look
    the same; only a connect error proves nothing was sent."""
    exc, calls = await _fail([aiohttp.ServerDisconnectedError()])
    assert calls == 1
    assert exc.cause == "reset"
    assert exc.delivered and not exc.refused


async def test_connect_errors_are_refusals_that_delivered_nothing() -> None:
    key = aiohttp.client_reqrep.ConnectionKey("b", 1, False, True, None, None, None)
    refused = aiohttp.ClientConnectorError(key, OSError(111, "Connect call failed ('b', 1)"))
    for err in (refused, aiohttp.ConnectionTimeoutError()):
        exc, calls = await _fail([err])
        assert calls == 1
        assert exc.cause == "connect"
        assert exc.refused and not exc.delivered
    assert "('b', 1)" not in str(exc), "the OS message repeats the address"


async def test_no_headers_before_the_deadline_is_a_timeout_naming_the_setting() -> None:
    class _Hung:
        async def post(self, url: str, **kwargs: Any) -> _Resp:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    with pytest.raises(AttemptFailed) as info:
        await open_upstream(_Hung(), "http://b/x", b"{}", {}, _in(0.01))  # type: ignore[arg-type]
    assert info.value.timeout and not info.value.refused
    assert "0.01 s (timeouts.x_s)" in str(info.value)
