"""Active health checks and model discovery, one background loop per app.

Every ``interval_s`` each backend gets ``GET /health`` and, when healthy,
``GET /v1/models``; results go to ``Backends.record_probe`` / ``set_models``, which tell
the Fleet. The loop also ticks time-driven circuit transitions. It never touches load
counters (a known fault of other routers is a health loop that zeroes them).
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


async def probe(state: RouterState, rt: BackendRuntime) -> None:
    """One health probe (and model discovery) of one backend."""
    assert state.session is not None, "probe runs after startup created the session"
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s)
    headers = {"Authorization": rt.auth_header} if rt.auth_header else {}
    ok, error = False, None
    try:
        async with state.session.get(rt.url + "/health", timeout=timeout, headers=headers) as r:
            await r.read()
            ok = r.status == 200
            error = None if ok else f"/health answered {r.status}"
        if ok:
            cards = await _models(state.session, rt.url, timeout, headers)
            if cards is not None:
                state.backends.set_models(rt.url, cards)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        ok, error = False, f"/health: {type(exc).__name__}: {exc}"
    was = rt.probe_ok
    state.backends.record_probe(rt.url, ok, error)
    if was != rt.probe_ok:
        level = logging.INFO if rt.probe_ok else logging.WARNING
        log.log(level, "backend %s is now %s", rt.url, "healthy" if rt.probe_ok else "unhealthy")


async def _models(
    session: aiohttp.ClientSession,
    url: str,
    timeout: aiohttp.ClientTimeout,
    headers: dict[str, str],
) -> list[dict[str, Any]] | None:
    async with session.get(url + "/v1/models", timeout=timeout, headers=headers) as r:
        raw = await r.read()
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
