"""Opening one upstream request: connect, send the original bytes, wait for the headers.

Failures before the first byte become ``AttemptFailed`` (retryable on another backend).
A keep-alive connection the backend closed while idle shows up as a disconnect before
any byte; that one case is retried once on the same backend, on a fresh connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from kvroute.router.errors import BackendFailed, BackendTimeout

# response headers never copied back to the client (hop-by-hop or recomputed by aiohttp)
SKIP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "date",
        "server",
        "proxy-authenticate",
        "trailer",
        "upgrade",
    }
)


class AttemptFailed(Exception):
    """One backend failed before producing output; ``cause`` labels the retry metric."""

    def __init__(self, cause: str, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.cause = cause  # "connect" | "timeout" | "5xx" | "reset"
        self.timeout = timeout

    def to_client_error(self) -> BackendFailed | BackendTimeout:
        if self.timeout:
            return BackendTimeout(str(self))
        return BackendFailed(str(self))


async def open_upstream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    first_byte_s: float,
) -> aiohttp.ClientResponse:
    """POST ``body`` to ``url``; the response once its headers arrived (status < 500).

    Raises AttemptFailed on connect errors, resets, a first-byte timeout or a 5xx (whose
    body is read, bounded, into the message). The caller owns and must close the response.
    """
    for stale_retry in (False, True):
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await session.post(url, data=body, headers=headers)
        except TimeoutError:
            raise AttemptFailed(
                "timeout", f"{url}: no response within {first_byte_s:g} s", timeout=True
            ) from None
        except aiohttp.ServerDisconnectedError as exc:
            if not stale_retry:
                continue  # an idle pooled connection closed by the backend: once more
            raise AttemptFailed("reset", f"{url}: connection closed: {exc}") from None
        except aiohttp.ClientConnectorError as exc:
            raise AttemptFailed("connect", f"{url}: cannot connect: {exc.os_error}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AttemptFailed("reset", f"{url}: {type(exc).__name__}: {exc}") from None
        if resp.status >= 500:
            detail = await _error_detail(resp)
            raise AttemptFailed("5xx", f"{url} answered {resp.status}: {detail}")
        return resp
    raise AssertionError("unreachable: the loop returns or raises")


async def _error_detail(resp: aiohttp.ClientResponse) -> str:
    """Up to 300 bytes of an error body (bounded in time), then the connection is closed."""
    try:
        async with asyncio.timeout(1.0):
            data = await resp.content.read(300)
        return data.decode("utf-8", "replace").strip() or resp.reason or ""
    except (TimeoutError, aiohttp.ClientError, OSError):
        return resp.reason or ""
    finally:
        resp.close()


def copy_response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in SKIP_RESPONSE_HEADERS}
