"""Admin API: list, add, remove and drain backends, behind a bearer admin key.

With no admin key configured the API is off (403): an open admin API on a proxy that
holds backend credentials is a hole, so it must be switched on deliberately. With
``admin_allowed_backends`` set, a backend may only be added on an allowed host (403
otherwise), so a leaked admin key cannot point the router anywhere on the network.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from kvroute.core.params import build
from kvroute.router.body import continue_when_read, json_error, read_body
from kvroute.router.clients import bearer_token
from kvroute.router.config import BackendConfig, normalize_url
from kvroute.router.errors import BadRequest, Forbidden, NotFound, Unauthorized
from kvroute.router.health import probe
from kvroute.router.state import STATE, RouterState
from kvroute.router.status import backend_rows

_decode = msgspec.json.Decoder().decode
log = logging.getLogger(__name__)


def _audit(request: web.Request, what: str) -> None:
    """One line per change to the fleet, naming who asked: an audit trail, at WARNING so
    that the default log level (WARNING) keeps it."""
    log.warning("admin: %s (from %s)", what, request.remote or "unknown")


def authorize(request: web.Request) -> RouterState:
    """The state, if the request carries the admin key (Forbidden when the API is off)."""
    state = request.app[STATE]
    key = state.config.admin_key
    if key is None:
        raise Forbidden("the admin API is disabled: set admin_key (or --admin-key) to enable it")
    token = bearer_token(request.headers.get("Authorization")) or ""
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise Unauthorized("missing or invalid admin key")
    return state


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request, request.app[STATE].config.limits.max_body_bytes)
    try:
        body = _decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise json_error("body", raw, exc) from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


async def _url_of(request: web.Request) -> str:
    url = request.query.get("url") or (await _json_object(request)).get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required (JSON body or ?url=)")
    return _backend_key(url)


def _backend_key(url: str) -> str:
    """``url`` spelled as backends are keyed (normalize_url: ``HTTP://h:01/`` finds
    ``http://h:1``); a string that is no backend URL as given, so it finds nothing."""
    try:
        return normalize_url(url)
    except ValueError:
        return url.rstrip("/")


async def handle_list(request: web.Request) -> web.Response:
    state = authorize(request)
    return web.json_response({"backends": backend_rows(state)})


async def handle_add(request: web.Request) -> web.Response:
    """Add a backend; it takes traffic after its first good health probe (run at once)."""
    state = authorize(request)
    body = await _json_object(request)
    try:  # the YAML's checks: types, ranges and unknown fields, named by key
        config = build(BackendConfig, body, "backend")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    check_allowed(config, state.config.admin_allowed_backends)
    if state.backends.get(config.url) is not None:
        raise BadRequest(f"backend {config.url} is already present")
    if config.name is not None and any(rt.config.name == config.name for rt in state.backends):
        raise BadRequest(f"a backend named {config.name!r} is already present")
    rt = state.add_backend(config)
    _audit(request, f"added backend {rt.url}")
    await probe(state, rt)
    followed = state.kv is not None and config.kv_events is not None
    return web.json_response(
        {
            "url": rt.url,
            "healthy": rt.routable,
            "models": list(rt.models),
            "kv_events": config.kv_events if followed else None,
        },
        status=201,
    )


def check_allowed(config: BackendConfig, allowed: Sequence[str]) -> None:
    """Forbidden unless the backend's host, and its tcp:// KV endpoints' hosts, are in
    ``admin_allowed_backends`` (no list: anything goes). No DNS lookups: an IP literal
    must fall in a CIDR or match a glob, a name must match a glob; ipc:// is refused."""
    if not allowed:
        return
    hosts = [urlsplit(config.url).hostname or ""]
    for endpoint in (config.kv_events, config.kv_replay):
        if endpoint is None:
            continue
        if not endpoint.startswith("tcp://"):
            raise Forbidden(
                "only tcp:// KV endpoints may be added while admin_allowed_backends is set"
            )
        hosts.append(urlsplit(endpoint).hostname or "")
    for host in hosts:
        if not host_allowed(host, allowed):
            raise Forbidden(f"host {host!r} is not in admin_allowed_backends")


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether ``host`` (an IP literal or a name) matches a CIDR or glob of ``allowed``."""
    host = host.lower()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for pattern in allowed:
        try:
            net = ipaddress.ip_network(pattern, strict=False)
        except ValueError:
            if fnmatch.fnmatchcase(host, pattern):
                return True
            continue
        if ip is not None and ip.version == net.version and ip in net:
            return True
    return False


async def handle_remove(request: web.Request) -> web.Response:
    """Remove at once; in-flight requests on it finish, their load release is a no-op."""
    state = authorize(request)
    url = await _url_of(request)
    try:
        state.remove_backend(url)  # its KV-event feed stops too
    except KeyError:
        raise NotFound(f"no backend {url}") from None
    _audit(request, f"removed backend {url}")
    return web.json_response({"removed": url})


async def handle_drain(request: web.Request) -> web.Response:
    """Stop sending new requests to a backend (``"draining": false`` undoes it)."""
    state = authorize(request)
    body = await _json_object(request)
    url = body.get("url") or request.query.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required")
    draining = body.get("draining", True)
    if not isinstance(draining, bool):
        raise BadRequest("'draining' must be a boolean")
    url = _backend_key(url)
    if state.backends.get(url) is None:
        raise NotFound(f"no backend {url}")
    state.backends.set_draining(url, draining)
    _audit(request, f"{'drained' if draining else 'undrained'} backend {url}")
    row = next(r for r in backend_rows(state) if r["url"] == url)
    return web.json_response(
        {"url": url, "draining": draining, "in_flight": row["kvroute_backend_in_flight_requests"]}
    )


async def handle_kv(request: web.Request) -> web.Response:
    """Per backend, what the router's view holds (for checking it against the engines)."""
    state = authorize(request)
    return web.json_response({"mode": state.fleet.config.mode, "backends": kv_views(state)})


def kv_views(state: RouterState) -> list[dict[str, Any]]:
    """Held blocks per backend; in exact mode also the confirmed key count and a digest of
    the confirmed keys (sum mod 2**64), which a check can recompute from the events."""
    out = []
    # due speculations gone first, also with no traffic
    fleet_states = {s.url: s for s in state.fleet.backend_states(state.clock())}
    for url in state.fleet.urls():
        keys = state.fleet.confirmed_keys(url)  # None: approximate
        fs = fleet_states[url]
        sub = state.kv.status(url) if state.kv is not None else None
        row: dict[str, Any] = {
            "url": url,
            "mode": fs.mode,
            "index_blocks": fs.index_blocks,
            "confirmed_blocks": len(keys) if keys is not None else None,
            "speculative_blocks": fs.speculative_blocks if keys is not None else None,
            "confirmed_digest": str(sum(keys) % 2**64) if keys is not None else None,
            "kv_last_seq": sub.last_seq if sub is not None else None,
            "kv_running": sub.running if sub is not None else None,
            # predicted vs engine-reported cached tokens, over the responses that reported
            "num_reported": fs.num_reported,
            "num_reported_exact": fs.num_reported_exact,
            "reported_hit_tokens": fs.reported_hit_tokens,
            "reported_predicted_tokens": fs.reported_predicted_tokens,
        }
        out.append(row)
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/backends", handle_list)
    app.router.add_post("/admin/backends", handle_add, expect_handler=continue_when_read)
    app.router.add_delete("/admin/backends", handle_remove)
    app.router.add_post("/admin/backends/drain", handle_drain, expect_handler=continue_when_read)
    app.router.add_get("/admin/kv", handle_kv)
