"""Active health checks and model discovery, one background loop per app.

Every ``interval_s`` each backend gets ``GET /health`` and, when healthy,
``GET /v1/models``; an engine without ``/health`` (a 404: Ollama) is healthy when its
``/v1/models`` answers a model list. Results go to ``Backends.record_probe`` /
``set_models``, which tell the Fleet. The loop also ticks time-driven circuit
transitions. It never touches load
counters (a known fault of other routers is a health loop that zeroes them).

Probes and scrapes use their own connection pool (``make_probe_session``), never the
request pool: a backend whose request connections are all busy with long streams is busy,
not down, and a probe queued behind those streams would time out and mark it down. Probe
bodies are read up to a cap; a bigger body is a failed probe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec

from kvroute.router.backends import BackendRuntime
from kvroute.router.state import RouterState

log = logging.getLogger("kvroute.router.health")
_decode = msgspec.json.Decoder().decode

PROBE_MAX_BYTES = 1 << 20  # /health and /v1/models bodies (1 MiB: ~5,000 model cards)
METRICS_MAX_BYTES = 8 << 20  # a /metrics page (vLLM's: ~0.1-0.5 MB per engine)


class BodyTooLarge(Exception):
    """A probe's body went over its cap (the probe or scrape fails)."""


def make_probe_session() -> aiohttp.ClientSession:
    """The probes' own pool. No connection limit, so a probe never queues: each backend
    has at most three probes in flight by construction (the health round, the scraper, an
    admin add), so the pool holds at most three connections per backend."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # the caps count the bytes on the wire: no zip bombs
        skip_auto_headers=("User-Agent",),
        headers={"Accept-Encoding": "identity"},
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def probe_headers(rt: BackendRuntime) -> dict[str, str]:
    return {"Authorization": rt.auth_header} if rt.auth_header else {}


async def read_capped(resp: aiohttp.ClientResponse, path: str, limit: int) -> bytes:
    """The whole body, or BodyTooLarge once it passes ``limit`` bytes (read no further)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(f"{path}: body over {limit} bytes ({resp.content_length})")
    body = bytearray()
    while chunk := await resp.content.readany():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"{path}: body over {limit} bytes")
    return bytes(body)


async def probe(state: RouterState, rt: BackendRuntime) -> None:
    """One health probe (and model discovery) of one backend."""
    session = state.probe_session
    assert session is not None, "probe runs after startup created the probe pool"
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s)
    headers = probe_headers(rt)
    ok, error = False, None
    path = "/health"
    try:
        async with session.get(
            rt.url + path, timeout=timeout, headers=headers, allow_redirects=False
        ) as r:
            await read_capped(r, path, PROBE_MAX_BYTES)
            ok = r.status == 200
            error = None if ok else f"/health answered {r.status}"
            # no /health at all (Ollama): a model list that answers is the health signal
            no_health = r.status == 404
        if ok or no_health:
            path = "/v1/models"
            cards = await _models(session, rt.url, timeout, headers)
            if cards is not None:
                state.backends.set_models(rt.url, cards)
            elif no_health:
                error = "/health answered 404 and /v1/models gave no model list"
            ok = ok or cards is not None
    except BodyTooLarge as exc:
        ok, error = False, str(exc)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        ok, error = False, f"{path}: {type(exc).__name__}: {exc}"
    was = rt.probe_ok
    state.backends.record_probe(rt.url, ok, error)
    if was != rt.probe_ok:
        if rt.probe_ok:
            log.info("backend %s is now healthy", rt.url)
        else:
            log.warning("backend %s is now unhealthy: %s", rt.url, error)
    elif not ok and not rt.ever_healthy and rt.probe_failures == 1:
        # down since it was added: say so once, with the reason (it takes no traffic)
        log.warning("backend %s is not healthy yet: %s%s", rt.url, error, _url_hint(rt.url))


def _url_hint(url: str) -> str:
    """Advice for a backend URL that looks like an OpenAI base URL (".../v1")."""
    if url.rstrip("/").endswith("/v1"):
        return " (give the server's address without /v1: kvroute adds /v1/... itself)"
    return ""


async def _models(
    session: aiohttp.ClientSession,
    url: str,
    timeout: aiohttp.ClientTimeout,
    headers: dict[str, str],
) -> list[dict[str, Any]] | None:
    async with session.get(
        url + "/v1/models", timeout=timeout, headers=headers, allow_redirects=False
    ) as r:
        raw = await read_capped(r, "/v1/models", PROBE_MAX_BYTES)
        if r.status != 200:
            return None
    try:
        data = _decode(raw).get("data")
    except (msgspec.DecodeError, AttributeError):
        return None
    return data if isinstance(data, list) else None


async def probe_all(state: RouterState) -> None:
    await asyncio.gather(*(probe(state, rt) for rt in state.backends))
    state.backends.refresh()


async def health_loop(state: RouterState) -> None:
    """Probe forever; the first round already ran at startup."""
    interval_s = state.config.health.interval_s
    while True:
        await asyncio.sleep(interval_s)
        try:
            await probe_all(state)
        except Exception:  # a bug here must not stop health checking
            log.exception("health round failed")
