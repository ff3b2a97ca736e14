"""The router's view of its backends: health, circuit, models; keeps the Fleet in sync.

A backend is *routable* exactly when its last active probes say healthy and its circuit
breaker is not open; the Fleet is told (``set_healthy``) whenever that changes, so the
request path never loops over the fleet. Model lists come from each backend's
``/v1/models``; ``model_is_known`` answers "404 or 503?" in O(1), and
``check_context`` refuses a ``max_tokens`` above the model's context (vLLM's cards carry
``max_model_len``) in O(1) too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.common.vllm_metrics import EngineMetrics
from kvroute.core.policy.base import fits_context
from kvroute.router.breaker import CircuitBreaker, CircuitState
from kvroute.router.config import BackendConfig, BreakerConfig, HealthConfig
from kvroute.router.errors import BadRequest
from kvroute.router.request import ParsedRequest

log = logging.getLogger("kvroute.router.backends")


class FleetLike(Protocol):
    """The part of ``kvroute.core.fleet.Fleet`` this module drives."""

    def add_backend(
        self, url: str, *, models: Any = (), weight: float = 1.0, healthy: bool = True
    ) -> None: ...
    def remove_backend(self, url: str) -> None: ...
    def set_models(self, url: str, models: Any) -> None: ...
    def set_healthy(self, url: str, healthy: bool) -> None: ...
    def set_draining(self, url: str, draining: bool) -> None: ...
    def forget_cache(self, url: str) -> None: ...


@dataclass(slots=True)
class BackendRuntime:
    """Router-side state of one backend (the Fleet holds load and cache state)."""

    config: BackendConfig
    breaker: CircuitBreaker
    probe_ok: bool = False  # verdict of the active health checks
    ever_healthy: bool = False  # probe_ok was True once (a later recovery may be a restart)
    probe_failures: int = 0  # consecutive failed probes
    probe_successes: int = 0  # consecutive good probes
    models: tuple[str, ...] = ()  # ids from /v1/models, empty until discovered
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> card
    adapters: frozenset[str] = frozenset()  # ids whose card names a "parent" (LoRA)
    # id -> the card's max_model_len (None: the card does not say)
    model_to_max_len: dict[str, int | None] = field(default_factory=dict)
    draining: bool = False  # takes no new requests; in-flight ones finish
    routable: bool = False  # what the Fleet was last told via set_healthy
    last_error: str | None = None  # last probe or request failure, for the status page
    # headers sent upstream on every request (api key); built once
    auth_header: str | None = None
    engine: EngineMetrics | None = None  # last scraped engine gauges and counters
    # an answer of it reported cached prompt tokens once: from then on an answer with
    # usage but no count is a miss (SGLang's cache report leaves the field out at 0)
    reports_cached: bool = False

    @property
    def url(self) -> str:
        return self.config.url


class Backends:
    """Registry of BackendRuntime by URL, mirrored into the Fleet."""

    def __init__(
        self,
        fleet: FleetLike,
        breaker_config: BreakerConfig,
        health_config: HealthConfig,
        *,
        call_later: Callable[[float, Callable[[], None]], object] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._breaker_config = breaker_config
        self._health = health_config
        self._call_later = call_later
        self._clock = clock
        self._by_url: dict[str, BackendRuntime] = {}
        self._model_refs: dict[str, int] = {}  # model -> number of backends listing it
        self._num_unlisted = 0  # backends whose model list is unknown (serve anything)
        # model -> the largest context a backend listing it serves (None: one does not say)
        self._model_to_max_len: dict[str, int | None] = {}
        self.adapters: frozenset[str] = frozenset()  # LoRA adapter ids of any backend
        self._timers: dict[str, Any] = {}  # url -> pending half-open re-check
        self.num_routable = 0

    def close(self) -> None:
        """Cancel pending timers (app shutdown)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def __iter__(self) -> Iterator[BackendRuntime]:
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    def get(self, url: str) -> BackendRuntime | None:
        return self._by_url.get(url)

    def add(self, config: BackendConfig) -> BackendRuntime:
        if config.url in self._by_url:
            raise ValueError(f"backend {config.url} already present")
        rt = BackendRuntime(config=config, breaker=CircuitBreaker(self._breaker_config))
        if config.api_key:
            rt.auth_header = f"Bearer {config.api_key}"
        self._by_url[config.url] = rt
        self._num_unlisted += 1
        # not routable until its first good probe
        self._fleet.add_backend(config.url, models=(), weight=config.weight, healthy=False)
        return rt

    def remove(self, url: str) -> BackendRuntime:
        rt = self._by_url.pop(url, None)
        if rt is None:
            raise KeyError(url)
        timer = self._timers.pop(url, None)
        if timer is not None:
            timer.cancel()
        self._set_models(rt, ())
        self._set_adapters(rt, frozenset())
        self._set_max_lens(rt, {})
        self._num_unlisted -= 1
        if rt.routable:
            self.num_routable -= 1
        self._fleet.remove_backend(url)
        return rt

    # -- health and circuit ---------------------------------------------------------

    def record_probe(self, url: str, ok: bool, error: str | None = None) -> None:
        """One active health probe result; flips probe_ok after N in a row."""
        rt = self._by_url.get(url)
        if rt is None:
            return
        if ok:
            rt.probe_failures = 0
            rt.probe_successes += 1
            if not rt.probe_ok and rt.probe_successes >= self._health.healthy_after:
                rt.probe_ok = True
                rt.breaker.reset()  # a recovered backend starts with a clean slate
                if rt.ever_healthy:  # back after failed probes: maybe a restarted engine
                    self._fleet.forget_cache(url)
                rt.ever_healthy = True
        else:
            rt.last_error = error
            rt.probe_successes = 0
            rt.probe_failures += 1
            if rt.probe_ok and rt.probe_failures >= self._health.unhealthy_after:
                rt.probe_ok = False
        self._sync(rt)

    def begin_attempt(self, url: str) -> None:
        """A request was sent to ``url``: a half-open circuit lets no other through now."""
        rt = self._by_url.get(url)
        if (
            rt is not None
            and rt.breaker.state is CircuitState.HALF_OPEN
            and rt.breaker.begin_attempt()
        ):
            self._sync(rt)

    def end_attempt(self, url: str) -> None:
        """The attempt is over (verdict or not): a trial without one frees the circuit."""
        rt = self._by_url.get(url)
        if rt is not None and rt.breaker.trial_in_flight:
            rt.breaker.end_attempt()
            self._sync(rt)

    def record_success(self, url: str) -> None:
        rt = self._by_url.get(url)
        if rt is None or (rt.breaker.state is CircuitState.CLOSED and not rt.breaker.failures):
            return  # the common case costs two attribute reads
        rt.breaker.record_success()
        self._sync(rt)

    def record_failure(self, url: str, error: str) -> None:
        rt = self._by_url.get(url)
        if rt is None:
            return
        rt.last_error = error
        was_open = rt.breaker.state is CircuitState.OPEN
        rt.breaker.record_failure(self._clock())
        if rt.breaker.state is CircuitState.OPEN and not was_open:
            log.warning("backend %s: circuit open, no traffic for %ss (last error: %s)",
                        url, self._breaker_config.open_s, error)  # fmt: skip
            self._sync(rt)
            if self._call_later is not None:
                # re-check right when the circuit may turn half-open
                old = self._timers.pop(url, None)
                if old is not None:
                    old.cancel()
                self._timers[url] = self._call_later(
                    self._breaker_config.open_s, lambda: self.refresh_one(url)
                )

    def refresh_one(self, url: str) -> None:
        rt = self._by_url.get(url)
        if rt is not None:
            self._sync(rt)

    def refresh(self) -> None:
        """Time-driven transitions (open -> half-open); called by the health loop."""
        for rt in self:
            self._sync(rt)

    def _sync(self, rt: BackendRuntime) -> None:
        routable = rt.probe_ok and rt.breaker.allows(self._clock())
        if routable != rt.routable:
            rt.routable = routable
            self.num_routable += 1 if routable else -1
            if not routable:
                rt.engine = None  # a dead engine's last gauges are not its state (Fleet too)
            self._fleet.set_healthy(rt.url, routable)

    def num_serving(self) -> int:
        """Backends that take new requests: routable and not draining."""
        return sum(1 for rt in self if rt.routable and not rt.draining)

    def set_draining(self, url: str, draining: bool) -> None:
        rt = self._by_url[url]
        rt.draining = draining
        self._fleet.set_draining(url, draining)

    # -- models -----------------------------------------------------------------------

    def set_models(self, url: str, cards: list[dict[str, Any]]) -> None:
        rt = self._by_url.get(url)
        if rt is None:
            return
        rt.model_cards = {str(c["id"]): c for c in cards if isinstance(c, dict) and "id" in c}
        self._set_models(rt, tuple(sorted(rt.model_cards)))
        self._set_adapters(rt, frozenset(m for m, c in rt.model_cards.items() if c.get("parent")))
        self._set_max_lens(rt, {m: _max_len(c) for m, c in rt.model_cards.items()})

    def _set_max_lens(self, rt: BackendRuntime, lens: dict[str, int | None]) -> None:
        """Recompute the fleet-wide context of the models whose card changed (rare: cards
        are re-read every probe, but they change only when a backend does)."""
        if lens == rt.model_to_max_len:
            return
        changed = set(lens) | set(rt.model_to_max_len)
        rt.model_to_max_len = lens
        for m in changed:
            listed = [r.model_to_max_len[m] for r in self if m in r.model_to_max_len]
            known = [n for n in listed if n is not None]
            if not listed:
                self._model_to_max_len.pop(m, None)
            else:
                self._model_to_max_len[m] = max(known) if len(known) == len(listed) else None

    def max_model_len(self, model: str) -> int | None:
        """The largest context any backend that may serve ``model`` gives it, from the
        cards' ``max_model_len``; None when unknown (a card does not say, or a backend
        whose model list is unknown might serve it). The largest, not the smallest: a
        request is refused only when no backend could take it."""
        if self._num_unlisted:
            return None
        return self._model_to_max_len.get(model)

    def check_context(self, model: str | None, parsed: ParsedRequest) -> None:
        """BadRequest when the client's own max_tokens, or a token-id prompt, does not fit
        ``model``'s context (the engines would refuse it; the router's default max_tokens
        is never refused)."""
        limit = self.max_model_len(model) if model is not None else None
        if limit is None:
            return
        field = parsed.max_tokens_field
        if field is not None and parsed.max_tokens > limit:
            raise BadRequest(f"'{field}' must be at most {limit}, the context length of '{model}'")
        ids = parsed.prompt.token_ids
        if ids is not None and not fits_context(len(ids), limit):
            raise BadRequest(
                f"'prompt' holds {len(ids)} token ids; the context length of '{model}' is {limit}"
            )

    def _set_adapters(self, rt: BackendRuntime, adapters: frozenset[str]) -> None:
        """vLLM lists a LoRA adapter with its base model as "parent"; its KV never mixes
        with the base model's (the engine keys its blocks with the adapter's name)."""
        if adapters == rt.adapters:
            return
        rt.adapters = adapters
        self.adapters = frozenset().union(*(r.adapters for r in self._by_url.values()))

    def _set_models(self, rt: BackendRuntime, models: tuple[str, ...]) -> None:
        if models == rt.models:
            return
        for m in rt.models:
            self._model_refs[m] -= 1
            if not self._model_refs[m]:
                del self._model_refs[m]
        for m in models:
            self._model_refs[m] = self._model_refs.get(m, 0) + 1
        if not rt.models:
            self._num_unlisted -= 1
        if not models:
            self._num_unlisted += 1
        rt.models = models
        if rt.url in self._by_url:
            self._fleet.set_models(rt.url, models)

    def model_is_known(self, model: str) -> bool:
        """Some backend (healthy or not) lists ``model``, or one's list is unknown: not 404."""
        return model in self._model_refs or self._num_unlisted > 0

    def only_model(self) -> str | None:
        """The single model served by the fleet, for requests that omit ``model``."""
        if len(self._model_refs) == 1:
            return next(iter(self._model_refs))
        return None

    def model_cards(self) -> list[dict[str, Any]]:
        """Union of model cards over routable backends (``GET /v1/models``)."""
        seen: dict[str, dict[str, Any]] = {}
        for rt in self:
            if rt.routable and not rt.draining:
                for mid, card in rt.model_cards.items():
                    seen.setdefault(mid, card)
        return [seen[m] for m in sorted(seen)]


def _max_len(card: dict[str, Any]) -> int | None:
    """A card's ``max_model_len`` when it is a positive integer (vLLM lists it)."""
    value = card.get("max_model_len")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None
