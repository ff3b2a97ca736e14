"""``make_app``: the router application that ``kvroute serve`` runs and the tests build.

The handlers are thin (style.md §7.12): parsing, the Fleet and relaying live in their own
modules. One middleware turns every error into the OpenAI shape and counts requests.
Long-lived resources (upstream pool, health loop, scraper) live in a cleanup context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvroute.core.fleet import Fleet
from kvroute.router import admin
from kvroute.router.backends import Backends
from kvroute.router.clients import ClientGate
from kvroute.router.config import RouterConfig
from kvroute.router.errors import KvrouteError, error_bytes
from kvroute.router.health import health_loop, probe_all
from kvroute.router.metrics import BackendCollector, RouterMetrics
from kvroute.router.proxy import CHAT_PATH, COMPLETIONS_PATH, handle_chat, handle_completions
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
}


# probes, scrapes and admin calls are not API requests
_UNCOUNTED_PATHS = frozenset({"/health", "/metrics", "/"})


def build_fleet(policy: str) -> Fleet:
    """The core Fleet with the named policy (ValueError lists the known names)."""
    from kvroute.core.policy import make_policy

    return Fleet(make_policy(policy))


def make_app(
    config: RouterConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    session: aiohttp.ClientSession | None = None,
    fleet: Fleet | None = None,
) -> web.Application:
    """The router app. ``session``: an upstream pool to use (else one is made and closed)."""
    fleet = fleet if fleet is not None else build_fleet(config.policy)
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
    )
    for backend in config.backends:
        backends.add(backend)
    metrics.add_collector(BackendCollector(lambda: backend_rows(state)))
    app = web.Application(
        client_max_size=config.limits.max_body_bytes, middlewares=[error_middleware]
    )
    app[STATE] = state
    app.router.add_post(COMPLETIONS_PATH, handle_completions)
    app.router.add_post(CHAT_PATH, handle_chat)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/", handle_status_page)
    admin.add_routes(app)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Startup: upstream pool, a first health round, background loops; then teardown."""
    state = app[STATE]
    own_session = state.session is None
    if own_session:
        state.session = make_session(state.config)
    try:
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
        state.backends.close()
        if own_session and state.session is not None:
            await state.session.close()


async def _on_shutdown(app: web.Application) -> None:
    """Draining: /health says 503 and new requests are refused; in-flight ones finish."""
    app[STATE].shutting_down = True


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


def _error_response(status: int, message: str, error_type: str, code: str) -> web.Response:
    return web.Response(
        body=error_bytes(message, error_type, code),
        status=status,
        content_type="application/json",
    )


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
        response = _error_response(exc.status, exc.message, exc.error_type, exc.code)
        response.headers.update(exc.headers)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = exc.status
        error_type, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", "http_error"))
        message = f"{exc.reason}: {request.method} {request.path}"
        return _error_response(exc.status, message, error_type, code)
    except asyncio.CancelledError:
        status = 499  # client closed the connection (nginx's convention)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(500, "internal router error", "internal_error", "internal_error")
    finally:
        if request.path not in _UNCOUNTED_PATHS and not request.path.startswith("/admin/"):
            state.metrics.count_request(status, note.backend, note.reason)
            if note.backend:
                state.metrics.of(note.backend).e2e.observe(state.clock() - note.t0)


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.gate.require_key:
        state.gate.release(state.gate.admit(request.headers.get("Authorization")))
    body = {"object": "list", "data": state.backends.model_cards()}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = state.backends.num_routable
    ok = healthy > 0 and not state.shutting_down
    body = {
        "status": "ok" if ok else ("draining" if state.shutting_down else "no healthy backend"),
        "healthy_backends": healthy,
        "backends": len(state.backends),
    }
    return web.Response(
        body=msgspec.json.encode(body), status=200 if ok else 503, content_type="application/json"
    )


async def handle_metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})
