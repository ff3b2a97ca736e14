"""The router app's shared state, stored under one typed ``web.AppKey``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.core.fleet import Fleet
from kvroute.core.token_keys import BuiltinPromptTokenizer, PromptTokenizer
from kvroute.router.backends import BackendRuntime, Backends
from kvroute.router.clients import ClientGate
from kvroute.router.config import BackendConfig, RouterConfig
from kvroute.router.kv_subscriber import KvEventSubscriber
from kvroute.router.metrics import RouterMetrics

BUILTIN_TOKENIZER = BuiltinPromptTokenizer()


@dataclass(slots=True)
class RouterState:
    """Everything a handler needs; built by ``make_app``, filled by its cleanup context."""

    config: RouterConfig
    clock: Callable[[], float]  # monotonic seconds; the Fleet, breakers and limits use it
    fleet: Fleet  # the core: backends, index, load, policy
    backends: Backends
    gate: ClientGate
    metrics: RouterMetrics
    session: aiohttp.ClientSession | None = None  # upstream pool; set at startup
    # the probes' own pool (health, /v1/models, /metrics); made and closed by the app
    probe_session: aiohttp.ClientSession | None = None
    shutting_down: bool = False  # /health answers 503 and new requests get 503
    # the drain's time is up: the handlers still running were cancelled to end now
    drain_expired: bool = False
    # the tasks of the proxied requests being handled now (the drain cancels them)
    handlers: set[asyncio.Task[Any]] = field(default_factory=set)
    # background tasks of this app (health, scraper, probes of added backends)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # KV-event feeds (exact/auto mode; None in approximate mode); started at startup
    kv: KvEventSubscriber | None = None
    # served model -> its tokenizer for exact keys; others use the built-in one
    model_to_tokenizer: dict[str, PromptTokenizer] = field(default_factory=dict)

    @property
    def num_in_flight(self) -> int:
        """Proxied requests being handled now."""
        return len(self.handlers)

    def tokenizer_for(self, model: str | None) -> PromptTokenizer:
        """The tokenization the engines serving ``model`` use (exact-mode keys)."""
        if model is None:
            return BUILTIN_TOKENIZER
        return self.model_to_tokenizer.get(model, BUILTIN_TOKENIZER)

    def add_backend(self, config: BackendConfig) -> BackendRuntime:
        """A new backend in the registry and the Fleet, and its KV events followed."""
        rt = self.backends.add(config)
        if self.kv is not None and config.kv_events is not None:
            self.kv.add_backend(config.url, config.kv_events, config.kv_replay)
        return rt

    def remove_backend(self, url: str) -> BackendRuntime:
        """Drop a backend: registry and Fleet, its KV feed, its metric series (KeyError if
        unknown)."""
        rt = self.backends.remove(url)
        if self.kv is not None:
            self.kv.remove_backend(url)
        self.metrics.forget(url)
        return rt

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, tracked so shutdown can cancel it."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


STATE: web.AppKey[RouterState] = web.AppKey("kvroute_state", RouterState)


@dataclass(slots=True)
class RequestNote:
    """Per-request facts shared by the middleware and the handlers."""

    t0: float  # arrival, clock seconds
    request_id: str = ""  # x-request-id (the client's, or generated)
    backend: str = ""  # backend that answered ("" when none did)
    reason: str = ""  # x-kvroute-decision of that answer


NOTE: web.RequestKey[RequestNote] = web.RequestKey("kvroute_note", RequestNote)
