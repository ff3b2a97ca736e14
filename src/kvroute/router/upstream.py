"""Opening one upstream request: connect, send the original bytes, wait for the headers.

Failures before any of the answer was relayed become ``AttemptFailed``. Only those that
say the backend could not take the request (``refused``: a connect error, a 503 or
429, a 2xx that is no API answer, a redirect, never followed) are
retried on another backend and count against its circuit; the rest (another 5xx, a
dropped connection, a timeout) may be what this body caused, so they go back to the
client and blame no backend.

A body is sent to a backend once. A pooled keep-alive connection that the backend closed
just as the request went out fails exactly like a backend that dropped the connection
while it read or ran this body (``ServerDisconnectedError`` either way), so neither is
re-sent: only a connect error proves the request never reached the backend. The pool
keeps idle connections 4 s (``make_session``), under the 5 s keep-alive of uvicorn
(vLLM's and SGLang's server), and aiohttp checks that age when it hands one out: the race
needs a backend whose keep-alive is shorter than the pool's.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from kvroute.router.cutoff import cutoff_at
from kvroute.router.errors import BackendBusy, BackendFailed, BackendTimeout

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
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        # the router's own: an engine's copy (vLLM's --enable-request-id-headers echoes
        # its request id) would go out beside the router's, and clients join the two
        "x-request-id",
    }
)


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point in loop time and the setting that put it there (named in timeout errors)."""

    at: float  # asyncio loop.time() seconds
    seconds: float  # its configured length
    setting: str  # e.g. "timeouts.response_s"

    def describe(self) -> str:
        return f"{self.seconds:g} s ({self.setting})"


class AttemptFailed(Exception):
    """One backend failed before any of its answer was relayed.

    ``cause`` labels the retry metric: "connect" | "503" | "5xx" | "reset" | "timeout" |
    "not_api" (a 2xx that is neither JSON nor an event stream: a web page, not an engine).
    """

    def __init__(
        self, cause: str, message: str, *, timeout: bool = False, retry_after: str | None = None
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.timeout = timeout
        self.retry_after = retry_after  # a 503's Retry-After, when the backend sent one

    @property
    def refused(self) -> bool:
        """The backend could not take the request: retry elsewhere, count against it."""
        return self.cause in ("connect", "503", "not_api")

    @property
    def delivered(self) -> bool:
        """The body may have reached the backend (only a connect error proves it did not)."""
        return self.cause != "connect"

    def to_client_error(self) -> BackendFailed | BackendTimeout | BackendBusy:
        if self.timeout:
            return BackendTimeout(str(self))
        if self.cause == "503":  # the engines cannot take work now: so says the router
            return BackendBusy(str(self), headers={"Retry-After": self.retry_after or "1"})
        return BackendFailed(str(self))


# above this aiohttp writes a bytes body in one go (and warns); a BytesIO is sent in
# chunks that yield to the loop between them
_CHUNKED_BODY_BYTES = 1 << 20


def _payload(body: bytes) -> bytes | io.BytesIO:
    return io.BytesIO(body) if len(body) > _CHUNKED_BODY_BYTES else body


async def open_upstream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    deadline: Deadline,
) -> aiohttp.ClientResponse:
    """POST ``body`` to ``url`` once; the response once its headers arrived (status < 500,
    not 429).

    Raises AttemptFailed on a connect error, a dropped connection, no headers before
    ``deadline``, a 429 or a 5xx (whose body is read, bounded, into the message). The caller
    owns and must close the response.
    """
    try:
        async with cutoff_at(deadline.at):
            # never follow a redirect: it would send the prompt on to wherever it points
            resp = await session.post(
                url, data=_payload(body), headers=headers, allow_redirects=False
            )
    except aiohttp.ClientConnectorError as exc:
        raise AttemptFailed("connect", f"{url}: cannot connect: {_reason(exc.os_error)}") from None
    except aiohttp.ConnectionTimeoutError:  # sock_connect: no connection, nothing sent
        raise AttemptFailed("connect", f"{url}: cannot connect: timed out") from None
    except TimeoutError:
        raise AttemptFailed(
            "timeout", f"{url} did not answer within {deadline.describe()}", timeout=True
        ) from None
    except aiohttp.ServerDisconnectedError:
        raise AttemptFailed("reset", f"{url} closed the connection before answering") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise AttemptFailed(
            "reset", f"{url}: connection failed before answering: {type(exc).__name__}: {exc}"
        ) from None
    if resp.status >= 500 or resp.status == 429:
        detail = await _error_detail(resp)
        # a gateway's 504 in front of the engine is a timeout; other 5xx a failure; a 429
        # is an engine saying it is full (TGI's "Model is overloaded"), as a 503 does
        cause = "503" if resp.status in (503, 429) else "5xx"
        msg = f"{url} answered {resp.status}: {detail}"
        after = resp.headers.get("Retry-After", "")
        after = after if after.isdigit() and len(after) <= 5 else None  # seconds, sane
        raise AttemptFailed(cause, msg, timeout=resp.status == 504, retry_after=after)
    if 300 <= resp.status < 400:  # a redirect (never followed)
        where = resp.headers.get("Location", "")[:120]
        why = (f"(a redirect to {where!r}): kvroute does not follow an engine's redirects; "
               "configure the backend by the URL that answers")  # fmt: skip
    elif resp.status < 300 and not _is_api_answer(resp):  # a 4xx goes back as it is
        ctype = resp.headers.get("Content-Type", "")[:80]
        why = (f"with Content-Type {ctype!r}, not JSON or an event stream: is it an "
               "OpenAI-compatible server (a URL without /v1)?")  # fmt: skip
    else:
        return resp
    resp.close()
    raise AttemptFailed("not_api", f"{url} answered {resp.status} {why}")


# what an engine's success may be labelled: JSON, an event stream, or nothing said
# (aiohttp reads a missing Content-Type as octet-stream, which some servers also send)
_API_TYPES = frozenset({"application/json", "text/event-stream", "application/octet-stream"})


def _is_api_answer(resp: aiohttp.ClientResponse) -> bool:
    """A success an engine could have sent. Another type (a login page, a web UI, a
    proxy's placeholder) means the URL is not the engine's API, whatever the status."""
    ctype = resp.content_type
    return ctype in _API_TYPES or ctype.endswith("+json")


def _reason(err: OSError) -> str:
    """The errno's text ("Connection refused"): the OS message repeats the address."""
    return os.strerror(err.errno) if err.errno else type(err).__name__


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


def connection_tokens(headers: Mapping[str, str]) -> frozenset[str]:
    """The field names a message's Connection header lists (lower case): hop-by-hop for
    that one connection, never passed on (RFC 9110 section 7.6.1)."""
    connection = headers.get("Connection")
    if not connection:
        return frozenset()
    return frozenset(t.strip().lower() for t in connection.split(","))


def copy_response_headers(resp: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The answer's end-to-end headers, repeated ones (Set-Cookie) kept: without the
    hop-by-hop ones, those its Connection header names (RFC 9110 section 7.6.1), and the
    router's own (``x-request-id``, ``x-kvroute-*``), which the router sets."""
    skip = SKIP_RESPONSE_HEADERS | connection_tokens(resp.headers)
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in resp.headers.items():
        lower = k.lower()
        if lower not in skip and not lower.startswith("x-kvroute-"):
            out.add(k, v)
    return out
