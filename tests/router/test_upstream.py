"""open_upstream: one retry for a stale keep-alive connection, errors classified."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvroute.router.upstream import AttemptFailed, open_upstream


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


async def test_stale_keepalive_retried_once_on_same_backend() -> None:
    s = _Session([aiohttp.ServerDisconnectedError()])
    resp = await open_upstream(s, "http://b/v1/completions", b"{}", {}, 1.0)  # type: ignore[arg-type]
    assert resp.status == 200
    assert s.calls == 2


async def test_second_disconnect_is_an_attempt_failure() -> None:
    s = _Session([aiohttp.ServerDisconnectedError(), aiohttp.ServerDisconnectedError()])
    with pytest.raises(AttemptFailed) as info:
        await open_upstream(s, "http://b/x", b"{}", {}, 1.0)  # type: ignore[arg-type]
    assert info.value.cause == "reset"
    assert s.calls == 2


async def test_connect_error_not_retried_here() -> None:
    err = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("b", 1, False, True, None, None, None),
        OSError(111, "refused"),
    )
    s = _Session([err])
    with pytest.raises(AttemptFailed) as info:
        await open_upstream(s, "http://b/x", b"{}", {}, 1.0)  # type: ignore[arg-type]
    assert info.value.cause == "connect"
    assert s.calls == 1
