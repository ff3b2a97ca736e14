"""``make_app``: the router application that ``kvroute serve`` runs and the tests build.

The handlers are thin (docs/architecture.md, convention 8): parsing, the Fleet and
relaying live in their own modules. One middleware turns every error into the OpenAI
shape and counts requests. Long-lived resources (upstream pool, health loop, scraper,
KV-event feeds) live in a cleanup context.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.token_keys import PromptTokenizer
from kvroute.router import admin
from kvroute.router.backends import Backends
from kvroute.router.body import continue_when_read
from kvroute.router.clients import ClientGate
from kvroute.router.config import RouterConfig, backend_public_id
from kvroute.router.cors import Cors
from kvroute.router.errors import KvrouteError, error_bytes
from kvroute.router.health import health_loop, make_probe_session, probe_all
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.router.listener import listener_middleware, server_header
from kvroute.router.metrics import (
    BackendCollector,
    ProcessCollector,
    ReuseCollector,
    RouterMetrics,
    SessionCollector,
)
from kvroute.router.proxy import CHAT_PATH, COMPLETIONS_PATH, handle_chat, handle_completions
from kvroute.router.route_request import new_request_id
from kvroute.router.scraper import scrape_loop
from kvroute.router.state import NOTE, STATE, RequestNote, RouterState
from kvroute.router.status import backend_rows, handle_status_page

log = logging.getLogger("kvroute.router")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp's own HTTP errors (no route, wrong method, body too big) -> OpenAI type and code
_HTTP_ERRORS = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    501: ("invalid_request_error", "transfer_coding_not_implemented"),
    505: ("invalid_request_error", "http_version_not_supported"),
}


_API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")

# probes, scrapes and admin calls are not API requests
_UNCOUNTED_PATHS = frozenset({"/health", "/metrics", "/"})


def build_fleet(policy: str, params: object = None, config: FleetConfig | None = None) -> Fleet:
    """The core Fleet with the named policy (ValueError lists the known names), its
    parameters (None: defaults) and the Fleet's settings (``RouterConfig.fleet``)."""
    from kvroute.core.policy import make_policy

    return Fleet(make_policy(policy, params), config or FleetConfig())


def build_kv_subscriber(
    config: RouterConfig, fleet: Fleet, clock: Callable[[], float]
) -> KvEventSubscriber | None:
    """One feed per backend with ``kv_events`` (None in approximate mode: keys are text,
    events would only cost CPU; configured endpoints are then ignored with a warning)."""
    with_events = [b for b in config.backends if b.kv_events]
    if config.resolved_mode == "approximate":
        if with_events:
            log.warning("mode approximate: kv_events of %d backend(s) ignored", len(with_events))
        return None
    if not with_events:
        log.warning("mode %s without kv_events: no backend can be exact", config.resolved_mode)
    return KvEventSubscriber(
        fleet,
        {b.url: b.kv_events for b in with_events if b.kv_events},
        {b.url: b.kv_replay for b in with_events if b.kv_replay},
        clock=clock,
    )


def load_tokenizers(config: RouterConfig) -> dict[str, PromptTokenizer]:
    """The configured per-model tokenizers (ImportError/ValueError at startup, not later)."""
    from kvroute.router.hf_tokenizer import load_tokenizer

    return {model: load_tokenizer(path) for model, path in config.tokenizers.items()}


def make_app(
    config: RouterConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    session: aiohttp.ClientSession | None = None,
    fleet: Fleet | None = None,
) -> web.Application:
    """The router app. ``session``: an upstream pool to use (else one is made and closed)."""
    if fleet is None:
        fleet = build_fleet(config.policy, config.policy_params, config.fleet)
    metrics = RouterMetrics()
    backends = Backends(
        fleet,
        config.breaker,
        config.health,
        call_later=lambda delay_s, cb: asyncio.get_running_loop().call_later(delay_s, cb),
        clock=clock,
    )
    state = RouterState(
        config=config,
        clock=clock,
        fleet=fleet,
        backends=backends,
        gate=ClientGate(config.client_keys, clock),
        metrics=metrics,
        session=session,
        kv=build_kv_subscriber(config, fleet, clock),
        model_to_tokenizer=load_tokenizers(config),
    )
    for backend in config.backends:
        backends.add(backend)  # the subscriber already knows their endpoints
    metrics.add_collector(BackendCollector(lambda: backend_rows(state)))
    metrics.add_collector(ProcessCollector(lambda: state.num_in_flight))
    metrics.add_collector(SessionCollector(lambda: fleet.num_sessions(clock())))
    metrics.add_collector(ReuseCollector(fleet.reuse))
    cors = Cors(config.server.cors_origins) if config.server.cors_origins else None
    app = web.Application(
        client_max_size=config.limits.max_body_bytes,
        middlewares=[*([cors.preflight] if cors else []), error_middleware, listener_middleware],
    )
    app[STATE] = state
    app.router.add_post(COMPLETIONS_PATH, handle_completions, expect_handler=continue_when_read)
    app.router.add_post(CHAT_PATH, handle_chat, expect_handler=continue_when_read)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/", handle_status_page)
    admin.add_routes(app)
    app.on_response_prepare.append(server_header)
    if cors is not None:
        app.on_response_prepare.append(cors.stamp)
    if not config.expose_backend_urls:
        app.on_response_prepare.append(_hide_backend_header)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Startup: upstream and probe pools, a first health round, background loops; then
    teardown."""
    state = app[STATE]
    own_session = state.session is None
    if own_session:
        state.session = make_session(state.config)
    state.probe_session = make_probe_session()
    try:
        if state.kv is not None:
            await state.kv.start()  # feeds run beside the request path, never in it
        await probe_all(state)
        state.spawn(health_loop(state))
        if state.config.health.scrape_interval_s > 0:
            state.spawn(scrape_loop(state))
        yield
    finally:
        tasks = list(state.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if state.kv is not None:
            await state.kv.stop()
        state.backends.close()
        await state.probe_session.close()
        if own_session and state.session is not None:
            await state.session.close()


async def _on_shutdown(app: web.Application) -> None:
    """Draining: /health says 503 and new requests are refused; in-flight ones get
    ``drain_timeout_s`` to finish, then are ended (a stream with an SSE error event, a
    whole answer with 503). aiohttp's own drain cancels only after its timeout and then
    waits as long again for a stream that does not read its request: twice the time."""
    state = app[STATE]
    state.shutting_down = True
    asyncio.get_running_loop().call_later(state.config.drain_timeout_s, _end_drain, state)


def _end_drain(state: RouterState) -> None:
    state.drain_expired = True
    for task in list(state.handlers):
        task.cancel()


def make_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The pooled upstream client: keep-alive shorter than uvicorn's 5 s (vLLM's server)."""
    limits, timeouts = config.limits, config.timeouts
    connector = aiohttp.TCPConnector(
        limit=limits.max_connections,
        limit_per_host=limits.max_connections_per_backend,
        keepalive_timeout=4.0,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies (and skips the work)
    )


def _error_response(
    status: int, message: str, error_type: str, code: str, request_id: str
) -> web.Response:
    return web.Response(
        body=error_bytes(message, error_type, code),
        status=status,
        content_type="application/json",
        headers={"x-request-id": request_id},  # as every answer has: errors are traced too
    )


def _request_id(request: web.Request) -> str:
    """The request's id (the client's x-request-id, else one of ours), also when it failed
    before the router read it."""
    note = request[NOTE]
    if not note.request_id:
        note.request_id = request.headers.get("x-request-id") or new_request_id()
    return note.request_id


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one translation point: KvrouteError / HTTP errors / bugs -> OpenAI error JSON."""
    state = request.app[STATE]
    note = request[NOTE] = RequestNote(t0=state.clock())
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except KvrouteError as exc:
        status = exc.status
        rid = _request_id(request)
        if status >= 500:  # the router's or a backend's failure: the operator's to see
            log.warning("request %s: %d %s: %s", rid, status, exc.code, exc.message)
        message = exc.message
        if not state.config.expose_backend_urls:
            message = hide_backend_urls(state, message)
        response = _error_response(exc.status, message, exc.error_type, exc.code, rid)
        response.headers.update(exc.headers)
        if exc.close:
            response.force_close()  # says "Connection: close" instead of a silent hang-up
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = exc.status
        error_type, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", "http_error"))
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 404 and request.path.startswith("/v1/"):
            message += f" (kvroute serves {', '.join(_API_PATHS)})"
        response = _error_response(exc.status, message, error_type, code, _request_id(request))
        if "Allow" in exc.headers:  # a 405 says which methods the path takes
            response.headers["Allow"] = exc.headers["Allow"]
        if exc.status in (501, 505):
            response.force_close()  # the connection's framing is not one the router reads
        return response
    except asyncio.CancelledError:
        status = 499  # client closed the connection (nginx's convention)
        raise
    except Exception:
        rid = _request_id(request)
        log.exception("request %s: unhandled error on %s %s", rid, request.method, request.path)
        return _error_response(
            500, "internal router error", "internal_error", "internal_error", rid
        )
    finally:
        if request.path not in _UNCOUNTED_PATHS and not request.path.startswith("/admin/"):
            state.metrics.count_request(status, note.backend, note.reason)
            if note.backend:
                state.metrics.of(note.backend).e2e.observe(state.clock() - note.t0)


BACKEND_HEADER = "x-kvroute-backend"
_URL = re.compile(r"https?://[^\s/'\"]+")
_IPV4 = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b")


def public_backend_id(state: RouterState, url: str) -> str:
    """What a client may see of backend ``url`` when URLs are hidden."""
    rt = state.backends.get(url)
    return rt.config.public_id if rt is not None else backend_public_id(url)


def hide_backend_urls(state: RouterState, message: str) -> str:
    """``message`` with every backend address in it replaced by the backend's public id.

    Upstream errors name a backend by URL, ``host:port`` or a socket-address tuple
    (``('10.0.0.7', 8000)``), replaced in that order over all backends (backends may share
    a host); whatever is left that looks like a URL (a backend removed meanwhile), an IPv4
    address or a backend's host name is replaced too.
    """
    backends = [(rt.config.public_id, rt.url, urlsplit(rt.url)) for rt in state.backends]
    forms = [
        *((url, pid) for pid, url, _ in backends),
        *((parts.netloc, pid) for pid, _, parts in backends),
        *((f"({parts.hostname!r}, {parts.port})", pid) for pid, _, parts in backends),
    ]
    for text, pid in forms:
        message = message.replace(text, pid)
    message = _URL.sub(lambda m: backend_public_id(m.group(0)), message)
    for _, _, parts in backends:
        if parts.hostname and not _IPV4.fullmatch(parts.hostname):
            message = message.replace(parts.hostname, "<host>")
    return _IPV4.sub("<address>", message)


async def _hide_backend_header(request: web.Request, response: web.StreamResponse) -> None:
    url = response.headers.get(BACKEND_HEADER)
    if url is not None:
        response.headers[BACKEND_HEADER] = public_backend_id(request.app[STATE], url)


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.gate.require_key:
        state.gate.release(state.gate.admit(request.headers.get("Authorization")))
    body = {"object": "list", "data": state.backends.model_cards()}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = state.backends.num_routable
    # ready only if some backend takes new requests: drained ones answer none of them
    serving = state.backends.num_serving() if healthy else 0
    ok = serving > 0 and not state.shutting_down
    if ok:
        status = "ok"
    elif state.shutting_down:
        status = "draining"
    else:
        status = "every healthy backend is draining" if healthy else "no healthy backend"
    body = {
        "status": status,
        "healthy_backends": healthy,
        "serving_backends": serving,
        "backends": len(state.backends),
    }
    return web.Response(
        body=msgspec.json.encode(body), status=200 if ok else 503, content_type="application/json"
    )


async def handle_metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})
