"""The Fleet: the one object the live proxy, the discrete-event simulator and the tests drive.

It keeps the backends (membership, health, models) and the request path. The caller's
loop per request is: ``route`` (a Decision, or None when no backend is eligible) ->
``dispatch`` (a Ticket: load counted, blocks recorded in the index) -> ``on_first_token``
(prefill done; the rate learns) -> ``finish`` (load released, exactly once). Time is
always an argument; nothing here does I/O.

The parts it drives live beside it: each backend's record and counters (core/backend.py),
the load order (core/load_order.py), the per-model caches (core/served_models.py), the
view a policy decides through and its cost arithmetic (core/view.py, core/cost.py), the
prefix index (core/index.py), sessions (core/sessions.py), the listener contract
(core/listener.py). Two mixins add the engines' side to its API: their KV event streams
in exact mode (core/fleet_kv.py), and their scraped metrics, the text calibration of
approximate mode and the per-backend snapshots (core/fleet_engines.py).

Each dispatch also teaches its backend's working set (core/working_set.py): the blocks
its requests reuse. The cost model charges a placement for the part of that set its new
blocks would push out of the cache (core/cost.py), in both modes: the cache model says
how full the cache is, the router's own record of what its requests reused says what
the eviction destroys.

Numbers from clients and engines are bounded where they enter (``clamp_count``), and
``dispatch`` is all or nothing: a ticket the caller never gets is load never released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable
from random import Random

from kvroute.core.backend import Backend
from kvroute.core.calibration import TextCalibration, key_block_tokens
from kvroute.core.config import FleetConfig, KeyKind
from kvroute.core.cost import PrefillRate, RequestLifetime
from kvroute.core.fleet_engines import EngineReportsMixin
from kvroute.core.fleet_kv import KvEventsMixin
from kvroute.core.index import LruCacheModel, PrefixIndex
from kvroute.core.kv_sync import ExactSync
from kvroute.core.listener import FleetListener
from kvroute.core.load import MAX_COUNT, Ticket, clamp_count
from kvroute.core.load_order import LoadOrder
from kvroute.core.policy.base import (
    ESTIMATE_SLACK,
    Decision,
    Policy,
    RouteRequest,
    cached_tokens_for,
    fits_context,
)
from kvroute.core.reuse_regime import ReuseRegime
from kvroute.core.served_models import ServedModels
from kvroute.core.sessions import SessionTable, session_key
from kvroute.core.turnover import CacheTurnover
from kvroute.core.view import RequestView


def _bounded(req: RouteRequest) -> RouteRequest:
    """``req`` with token counts in [0, MAX_COUNT]: policies and the cost model do float
    arithmetic on them, which a client's 10**308 would overflow."""
    n, m = req.num_prompt_tokens, req.max_tokens
    if 0 <= n <= MAX_COUNT and 0 <= m <= MAX_COUNT:
        return req
    return dataclasses.replace(req, num_prompt_tokens=clamp_count(n), max_tokens=clamp_count(m))


WS_BUDGET = 2_000_000  # entries all working sets may hold at least, over the fleet


class Fleet(KvEventsMixin, EngineReportsMixin):
    """Backends, index, load, cost and policy behind one synchronous API (module doc)."""

    def __init__(
        self, policy: Policy, config: FleetConfig | None = None, *, rng: Random | None = None
    ) -> None:
        self.policy = policy
        self.config = config or FleetConfig()
        self.rng = rng if rng is not None else Random(0)
        self.index = PrefixIndex(self.config.max_index_entries or None)
        # how long a running request keeps its KV: the admission wait's clock (cost.py)
        self.lifetime = RequestLifetime(self.config.cost.lifetime_ewma_alpha)
        self._backends: dict[str, Backend] = {}
        self._order = LoadOrder()
        self._next_epoch = 0
        self._next_ticket = 0
        self.sync = ExactSync(self.index, self.config.mode, self.config.speculative_ttl_s)
        # per model: listing backends, and the eligible list, block size and key kind
        self._served = ServedModels(
            self._backends, self.sync, self.config.mode, self.config.default_block_size
        )
        # Prefill rate per unit of weight over the whole fleet: each backend's rate is this
        # x its weight x an offset its own samples learn slowly (cost.PrefillRate), so a new
        # backend is not judged on a few first tokens, nor on a pessimistic prior.
        self.fleet_rate = PrefillRate(self.config.cost)
        self.listeners: list[FleetListener] = []  # told of request-path changes
        self.calibration = TextCalibration()  # bytes of text per token, per model
        # session key (per model) -> backend of its last dispatch (core/sessions.py)
        self.sessions = SessionTable(self.config.session_ttl_s, self.config.session_max_entries)
        self.turnover = CacheTurnover()  # how fast each cache churns (cold placement)
        self.reuse = ReuseRegime()  # where reuse falls against the caches' residency

    # -- membership --------------------------------------------------------------------

    def add_backend(
        self, url: str, *, models: Iterable[str] = (), weight: float = 1.0, healthy: bool = True
    ) -> None:
        """Add a backend (not draining). ValueError if present or weight <= 0."""
        if url in self._backends:
            raise ValueError(f"backend already in the fleet: {url}")
        if not 0 < weight < math.inf:
            raise ValueError(f"weight must be > 0 and finite, got {weight}")
        self._next_epoch += 1
        stride = self.policy.active_blocks_stride
        b = Backend(url, self._next_epoch, models, float(weight), self.fleet_rate, stride)
        b.healthy = healthy
        self._backends[url] = b
        self._served.count(b.models, 1)
        self.index.add_backend(url, LruCacheModel(self._key_capacity(b)))
        self.sync.add_backend(url)
        self._membership_changed(b)

    def remove_backend(self, url: str) -> None:
        """Forget a backend: index entries, load and order dropped at once (unknown: no-op)."""
        b = self._backends.pop(url, None)
        if b is None:
            return
        self._served.count(b.models, -1)
        self.index.remove_backend(url)
        self.sync.remove_backend(url)
        self._order.discard(url)
        self._served.invalidate()
        self.sessions.forget_backend(url)
        self.turnover.forget(url)

    def set_models(self, url: str, models: Iterable[str]) -> None:
        b = self._get(url)
        self._served.count(b.models, -1)
        b.models = frozenset(models)
        self._served.count(b.models, 1)
        self._apply_capacity(b)
        self._membership_changed(b)

    def set_healthy(self, url: str, healthy: bool) -> None:
        """An unhealthy backend also loses its scraped engine gauges: a dead engine's last
        queue and KV usage must not count (the next scrape after recovery refills them)."""
        b = self._get(url)
        if not healthy:
            b.forget_engine_gauges()
        if b.healthy != healthy:
            b.healthy = healthy
            self._membership_changed(b)

    def forget_cache(self, url: str) -> None:
        """The engine may have restarted (it was unreachable, now answers again): its
        prefix cache is presumably empty, so the approximate model of it starts empty too,
        rather than sending prompts there for hits it no longer has. An exact view is left
        to the engine's events, which say what it holds (a restarted engine's new stream
        replaces the view)."""
        b = self._get(url)
        if self.sync.is_exact(url):
            return
        self.index.replace_model(url, LruCacheModel(self._key_capacity(b)))

    def set_draining(self, url: str, draining: bool) -> None:
        b = self._get(url)
        if b.draining != draining:
            b.draining = draining
            self._membership_changed(b)

    def urls(self) -> list[str]:
        """Every backend URL, sorted."""
        return sorted(self._backends)

    def _get(self, url: str) -> Backend:
        b = self._backends.get(url)
        if b is None:
            raise ValueError(f"unknown backend: {url}")
        return b

    def _membership_changed(self, b: Backend) -> None:
        if b.is_orderable:
            self._put_in_order(b)
        else:
            self._order.discard(b.url)
        self._served.invalidate()

    def _reorder(self, b: Backend) -> None:
        if b.is_orderable:
            self._put_in_order(b)

    def _put_in_order(self, b: Backend) -> None:
        self._order.put(b.url, b.models, b.load.in_flight_tokens, b.weight, b.tiebreak)

    def block_size_for(self, model: str | None) -> int:
        """Block size the keys of ``model`` are cut to: the most common among eligible backends."""
        return self._served.block_size(model)

    def key_kind_for(self, model: str | None) -> KeyKind:
        """ "tokens" when ``model``'s requests need token keys (token_block_hashes over the
        engine's token ids), else "text" (prompt_block_hashes); the proxy asks per request."""
        return self._served.key_kind(model)

    def cacheable(
        self, model: str | None, num_prompt_tokens: int, max_model_len: int | None
    ) -> bool:
        """``RouteRequest.cacheable`` of a prompt of ``num_prompt_tokens`` for ``model``: it
        may fit the context. The engine's own count (token keys) or an estimate on a
        learned ratio is taken as it is; a first estimate on the built-in ratio with
        ``ESTIMATE_SLACK``."""
        exact = self.key_kind_for(model) == "tokens" or self.prompt_tokens_learned(model)
        return fits_context(num_prompt_tokens, max_model_len, 0.0 if exact else ESTIMATE_SLACK)

    def is_eligible(self, url: str, model: str | None) -> bool:
        """Whether ``url`` may take a request for ``model`` now (a member, healthy, not
        draining, serving it): a retry checks each backend of a ranking made earlier."""
        b = self._backends.get(url)
        return b is not None and b.is_orderable and b.serves(model)

    # -- the request path --------------------------------------------------------------

    def route(self, req: RouteRequest, now: float, exclude: Iterable[str] = ()) -> Decision | None:
        """The policy's decision for ``req`` among eligible backends not in ``exclude``."""
        req = _bounded(req)
        self.sync.expire(now)
        r = self._key_bytes_per_token(req.model)
        view = RequestView(
            backends=self._backends,
            order=self._order,
            index=self.index,
            sessions=self.sessions,
            turnover=self.turnover,
            reuse_concave=self.reuse.concave is True,
            eligible=self._served.eligible(req.model),
            model=req.model,
            exclude=frozenset(exclude),
            block_size=key_block_tokens(self.block_size_for(req.model), r),
            bytes_per_token=r,
            config=self.config,
            rng=self.rng,
            now=now,
            lifetime_s=self.lifetime.mean_s,
        )
        if not self._order:
            return None
        return self.policy.choose(req, view, now)

    def dispatch(self, decision: Decision, req: RouteRequest, now: float) -> Ticket:
        """Commit to ``decision.backend``: count the load, record the prompt's blocks there.

        All or nothing: the ticket and the new means are computed before any counter
        moves, and a hook that raises afterwards (index, listener) has the
        dispatch undone before the exception propagates.
        """
        b = self._get(decision.backend)
        req = _bounded(req)
        self.sync.expire(now)
        num_held = self.index.matched_blocks(b.url, req.block_hashes)
        cached = self._cached_tokens(b, req, num_held)
        ticket = b.ticket(self._next_ticket + 1, req, cached, now)
        means_before = (b.load.mean_uncached_tokens, b.load.mean_decode_tokens)
        means = b.load.means_after(ticket)
        # commit: from here on only counters move
        self._next_ticket = ticket.ticket_id
        b.acquire(ticket, means)
        told = 0  # listeners that heard of the dispatch
        try:
            # a prompt the engine will refuse caches nothing there: none of it is recorded
            if req.cacheable and not self.sync.speculate(
                b.url, ticket.ticket_id, req.block_hashes, now
            ):
                self.index.insert(b.url, req.block_hashes)
            self._reorder(b)
            for listener in self.listeners:
                listener.on_dispatch(ticket, decision, req, now)
                told += 1
            if req.cacheable:
                self._learn_cache_use(b, req, ticket, num_held)
            if req.session is not None:  # last: a hook that raised leaves the session as it was
                self.sessions.put(session_key(req.model, req.session), b.url, now)
        except BaseException:
            self._undo_dispatch(b, ticket, means_before, now, told)
            raise
        return ticket

    def _learn_cache_use(
        self, b: Backend, req: RouteRequest, ticket: Ticket, num_held: int
    ) -> None:
        """What a dispatch tells of ``b``'s cache: which blocks are reused (its working set),
        how fast new ones come in (its turnover), and of the fleet's: how far apart reuses
        come (the reuse regime)."""
        window = self.index.url_to_model[b.url].capacity_blocks  # one cache turnover
        # the working sets together stay within the index's budget: its size, or the
        # 2M entries of the old fixed cap on fleets of smaller caches (where each keeps
        # up to 4 x its cache, as before)
        budget = self.config.max_index_entries or max(self.index.max_entries, WS_BUDGET)
        share = budget // max(1, len(self._backends))
        b.learn_reuse(req.block_hashes, num_held, window, share)
        capacity = (b.num_gpu_blocks or self.config.default_capacity_blocks) * (
            b.block_size or self.config.default_block_size
        )
        self.turnover.add(b.url, ticket.uncached_tokens, capacity, len(self._backends))
        keys = req.block_hashes
        self.reuse.observe(keys, len(keys) - num_held, self.index.total_capacity_blocks)

    def _undo_dispatch(
        self, b: Backend, ticket: Ticket, means: tuple[float, float], now: float, told: int
    ) -> None:
        """Take back a dispatch whose hooks raised (``means``: the load's before it)."""
        ticket.is_finished, ticket.ok = True, False
        self.sync.withdraw(ticket.ticket_id)
        b.unacquire(ticket, means)
        self._reorder(b)
        for listener in self.listeners[:told]:  # they mirror the dispatch: end it there too
            with contextlib.suppress(Exception):  # the first error is the one to report
                listener.on_finish(ticket, now, False)

    def session_backend(self, req: RouteRequest, now: float) -> str | None:
        """The backend ``req``'s session (``req.session`` on ``req.model``) last went to
        within the session TTL, eligible or not (None: no session or none recorded)."""
        if req.session is None:
            return None
        return self.sessions.get(session_key(req.model, req.session), now)

    def num_sessions(self, now: float) -> int:
        """Sessions with a recorded backend at ``now`` (expired ones dropped first)."""
        self.sessions.expire(now)
        return len(self.sessions)

    def predicted_cached_tokens(self, url: str, req: RouteRequest) -> int:
        """Tokens of ``req`` the cache model of ``url`` holds, as the engine would report them."""
        b = self._get(url)
        return self._cached_tokens(b, req, self.index.matched_blocks(url, req.block_hashes))

    def _cached_tokens(self, b: Backend, req: RouteRequest, num_held: int) -> int:
        bs = self.key_block_tokens(req.model, b.block_size or self.config.default_block_size)
        return cached_tokens_for(num_held, req.num_prompt_tokens, bs)

    def on_first_token(self, ticket: Ticket, now: float, cached_tokens: int | None = None) -> None:
        """Prefill done: release queued prefill tokens, learn the prefill rate (once)."""
        if ticket.is_finished or ticket.first_token_at_s is not None:
            return
        if cached_tokens is not None:
            cached_tokens = clamp_count(cached_tokens)  # the engine's word: bounded first
        ticket.first_token_at_s = now
        b = self._live(ticket)
        if b is not None:
            b.first_token(ticket, now, cached_tokens, self.fleet_rate)
            self._reorder(b)
        for listener in self.listeners:  # last: one that raises cannot skew the load
            listener.on_first_token(ticket, now, cached_tokens)

    def record_cached_tokens(self, ticket: Ticket, cached_tokens: int) -> None:
        """The engine's own hit for this request (usage.prompt_tokens_details.cached_tokens).

        For streams, usage arrives with the last chunk: call this then (before or after
        ``finish``); only the first report of a ticket counts.
        """
        b = self._live(ticket)
        if b is None or ticket.reported_cached_tokens is not None:
            return
        cached_tokens = clamp_count(cached_tokens)
        b.record_reported(ticket, cached_tokens)
        for listener in self.listeners:
            listener.on_cached_tokens(ticket, cached_tokens)

    def finish(self, ticket: Ticket, now: float, ok: bool) -> None:
        """The request ended (success, error, timeout, disconnect): release once; again: no-op."""
        if ticket.is_finished:
            return
        ticket.is_finished = True
        ticket.ok = ok
        if not ok:
            self.sync.withdraw(ticket.ticket_id)  # the engine will not cache its blocks
        if ok and ticket.first_token_at_s is not None:
            self.lifetime.observe(now - ticket.first_token_at_s)
        b = self._live(ticket)
        if b is not None:
            b.release(ticket, ok)
            self._reorder(b)
        # hooks last: one that raises cannot keep the load counted
        for listener in self.listeners:
            listener.on_finish(ticket, now, ok)

    def _live(self, ticket: Ticket) -> Backend | None:
        b = self._backends.get(ticket.url)
        return b if b is not None and b.epoch == ticket.epoch else None

    def check_invariants(self) -> None:
        """Index, load and order consistent with each other (tests call it after each step)."""
        self.index.check_invariants()
        self.sync.check_invariants()
        self.sessions.check_invariants()
        assert set(self.sessions.url_to_keys) <= set(self._backends), (
            "fleet: session of a gone backend"
        )
        assert set(self.index.url_to_model) == set(self._backends), "fleet: index membership"
        orderable = {u for u, b in self._backends.items() if b.is_orderable}
        assert set(self._order.url_to_entry) == orderable, "fleet: load order membership"
        self._served.check_invariants()
        for url, b in self._backends.items():
            b.check_invariants()
            if url in orderable:
                key = self._order.key_of(url)
                assert key[0] == b.load.in_flight_tokens / b.weight, "fleet: stale order key"
