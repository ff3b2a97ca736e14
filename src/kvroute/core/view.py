"""The fleet as one routing call sees it: the ``FleetView`` a policy chooses through.

A policy (core/policy/) sees neither backend records nor the index: it asks questions
(who is eligible, who is least loaded, who holds this prefix, what would it cost there)
of a ``RequestView`` built by ``Fleet.route`` for one request, with the request's model
and exclude list already applied. The view reads the Fleet's parts it is given and
changes nothing. Its TTFT estimate gathers one backend's numbers (cache size and fill,
working set, engine KV usage, queue, learned rate) for the arithmetic of core/cost.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from random import Random

from kvroute.core.backend import Backend
from kvroute.core.calibration import key_block_tokens
from kvroute.core.config import FleetConfig
from kvroute.core.cost import (
    CostConfig,
    estimate_ttft_s,
    evicted_blocks,
    evicted_hot_blocks,
    eviction_cost_s,
    kv_free_tokens,
    kv_need_tokens,
)
from kvroute.core.event_model import EventCacheModel
from kvroute.core.index import PrefixIndex
from kvroute.core.load_order import LoadOrder
from kvroute.core.policy.base import CacheSize, EngineGauges, LoadView, Placement, RouteRequest
from kvroute.core.sessions import SessionTable, session_key
from kvroute.core.turnover import CacheTurnover

MAX_UNKNOWN_RUNNING = 4096  # engine-reported requests beyond ours counted in a KV wait


class RequestView:
    """FleetView (core/policy/base.py) for one routing call: ``model`` and ``exclude``
    applied. ``eligible``: the backends serving ``model`` (by URL); ``block_size``: the
    tokens of one key block of the request; ``bytes_per_token``: the text calibration
    behind its key blocks (4.0 for token keys), which scales a backend's own block size
    into key-block tokens (core/calibration.py)."""

    __slots__ = (
        "_backends",
        "_bytes_per_token",
        "_default_block_size",
        "_eligible",
        "_exclude",
        "_index",
        "_lifetime_s",
        "_model",
        "_now",
        "_order",
        "_placed",
        "_placed_for",
        "_sessions",
        "_turnover",
        "block_size",
        "cost",
        "reuse_concave",
        "rng",
    )

    def __init__(
        self,
        *,
        backends: Mapping[str, Backend],
        order: LoadOrder,
        index: PrefixIndex,
        sessions: SessionTable,
        turnover: CacheTurnover,
        reuse_concave: bool,
        eligible: tuple[str, ...],
        model: str | None,
        exclude: frozenset[str],
        block_size: int,
        bytes_per_token: float,
        config: FleetConfig,
        rng: Random,
        now: float,
        lifetime_s: float | None = None,
    ) -> None:
        self._backends = backends
        self._order = order
        self._index = index
        self._sessions = sessions
        self._turnover = turnover
        self.reuse_concave = reuse_concave  # core/reuse_regime.py: spread new prompts
        self._eligible = eligible
        self._model = model
        self._exclude = exclude
        self.block_size = block_size
        self._bytes_per_token = bytes_per_token
        self._default_block_size = config.default_block_size
        self.cost: CostConfig = config.cost  # the cost model's knobs
        self.rng = rng  # the fleet's seeded generator
        self._now = now  # the routing call's time (session TTL)
        self._lifetime_s = lifetime_s  # a running request's KV lifetime (cost.py), if known
        # placements of one request already estimated in this call (a policy asks for the
        # same candidate again: the cold rule re-reads the estimates it ranked by)
        self._placed: dict[tuple[str, int], Placement] = {}
        self._placed_for: RouteRequest | None = None

    @property
    def excluded(self) -> frozenset[str]:
        return self._exclude

    def is_eligible(self, url: str) -> bool:
        return self._ok(url)

    def _ok(self, url: str) -> bool:
        b = self._backends.get(url)
        return (
            b is not None and b.is_orderable and b.serves(self._model) and url not in self._exclude
        )

    def _get(self, url: str) -> Backend:
        b = self._backends.get(url)
        if b is None:
            raise ValueError(f"unknown backend: {url}")
        return b

    def candidates(self) -> Sequence[str]:
        eligible = self._eligible
        if not self._exclude:
            return eligible
        return tuple(u for u in eligible if u not in self._exclude)

    def least_loaded(self, k: int) -> list[str]:
        out: list[str] = []
        if k <= 0:
            return out
        for url in self._order.urls(self._model):
            if url not in self._exclude:
                out.append(url)
                if len(out) >= k:
                    break
        return out

    def load(self, url: str) -> LoadView:
        b = self._get(url)
        requests, tokens, queued = b.load.merged()
        return LoadView(requests, tokens, queued, b.weight, b.load.in_flight_requests)

    def engine_gauges(self, url: str) -> EngineGauges:
        b = self._get(url)
        return EngineGauges(b.load.engine_num_waiting, b.kv_cache_usage, b.num_gpu_blocks)

    def mean_in_flight_tokens(self) -> float:
        return self._order.mean_tokens()

    def active_blocks(self, url: str, block_hashes: Sequence[int] = ()) -> int:
        active = self._get(url).active_blocks
        return active.num_blocks + active.num_new(block_hashes)

    def cache_size(self, url: str) -> CacheSize:
        model = self._index.url_to_model[url]
        return CacheSize(len(model), model.capacity_blocks, isinstance(model, EventCacheModel))

    def match(self, block_hashes: Sequence[int], max_holders: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for depth, mask in self._index.levels(block_hashes):
            need = max_holders - len(out)
            if need <= 0:
                break
            out.extend((u, depth) for u in self._least_loaded_of(mask, need))
        return out

    def _least_loaded_of(self, mask: int, need: int) -> list[str]:
        """The ``need`` least-loaded eligible holders in ``mask``; big sets scan the order."""
        if mask.bit_count() <= 4 * need + 16:
            ok = [u for u in self._index.urls_of(mask) if self._ok(u)]
            ok.sort(key=self._order.key_of)
            return ok[:need]
        out = []
        has_bit = self._index.has_bit
        for url in self._order.urls(self._model):
            if has_bit(mask, url) and url not in self._exclude:
                out.append(url)
                if len(out) >= need:
                    break
        return out

    def matched_blocks(self, url: str, block_hashes: Sequence[int]) -> int:
        return self._index.matched_blocks(url, block_hashes)

    def session_backend(self, session: str | None) -> str | None:
        if session is None:
            return None
        url = self._sessions.get(session_key(self._model, session), self._now)
        return url if url is not None and self._ok(url) else None

    def cache_turnover(self, url: str) -> float:
        return self._turnover.of(url)

    def _evictions(
        self, b: Backend, url: str, request: RouteRequest, cached_tokens: int
    ) -> tuple[int, int, int]:
        """(blocks ``request`` evicts on ``url``, how many of them are hot, key-block tokens)."""
        bs = key_block_tokens(b.block_size or self._default_block_size, self._bytes_per_token)
        model = self._index.url_to_model[url]
        held, capacity = len(model), model.capacity_blocks
        # Blocks this request adds to the cache push out as many held ones once it is full.
        new_blocks = max(0, request.num_prompt_tokens - cached_tokens) // bs
        evicted = evicted_blocks(held, capacity, new_blocks)
        hot = 0
        if evicted:  # only then is the working set asked (a binary search over the keys)
            ws = b.working_set
            keys = request.block_hashes
            joining = max(0, min(len(keys), capacity) - ws.num_hot_leading(keys))
            hot = evicted_hot_blocks(evicted, ws.num_hot, joining, capacity)
        return evicted, hot, bs

    def estimate_ttft_s(self, url: str, request: RouteRequest, cached_tokens: int) -> float:
        return self.placement(url, request, cached_tokens).ttft_s

    def _kv_releases(
        self, b: Backend, bs: float, foreign_tokens: float
    ) -> list[tuple[float, float]]:
        """When each request running on ``b`` is expected to end, and the KV it frees then,
        soonest first (core/cost.py). It ends a lifetime after its first token, at least a
        quarter of one from now; a lifetime from now if still queued; and frees its output
        and the blocks of its prompt no other running request shares. A request the engine
        ran at the last scrape that was not ours ends within half a lifetime and frees an
        equal share of ``foreign_tokens``."""
        life_s = self._lifetime_s if self._lifetime_s is not None else self.cost.kv_full_wait_s
        now = self._now
        active = b.active_blocks
        out = []
        for t in b.open_tickets.values():
            when_s = (
                life_s
                if t.first_token_at_s is None
                else max(life_s - (now - t.first_token_at_s), life_s / 4)
            )
            out.append((when_s, active.num_own(t.block_hashes) * bs + t.decode_tokens))
        foreign = min(b.foreign_requests, MAX_UNKNOWN_RUNNING)  # an absurd gauge: bounded
        if foreign:
            out += [(life_s / 2, foreign_tokens / foreign)] * foreign
        out.sort()
        return out

    @staticmethod
    def _foreign_tokens(b: Backend, capacity_tokens: float) -> float:
        """KV pinned or claimed on ``b`` by requests we did not send: the scraped usage's
        share that our requests of that moment did not explain (a scrape is up to an
        interval old; ours since then are counted fresh), plus the engine's queue beyond
        ours."""
        load = b.load
        pinned = (b.kv_cache_usage or 0.0) * b.foreign_kv_share * capacity_tokens
        return pinned + max(0, load.queued_prefill_tokens - load.queued_prefill_tokens_ours)

    def placement(self, url: str, request: RouteRequest, cached_tokens: int) -> Placement:
        # the Fleet does not change during a routing call, so a placement stays right
        if request is not self._placed_for:
            self._placed_for, self._placed = request, {}
        key = (url, cached_tokens)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = self._place(url, request, cached_tokens)
        return placed

    def _place(self, url: str, request: RouteRequest, cached_tokens: int) -> Placement:
        b = self._get(url)
        evicted, hot, bs = self._evictions(b, url, request, cached_tokens)
        capacity_tokens = self._index.url_to_model[url].capacity_blocks * bs
        queued = b.load.queued_prefill_tokens
        # what our requests in flight pin: their distinct blocks and their outputs at full
        # length (the engine grows them block by block; a newcomer cannot have those)
        active = b.active_blocks
        prompts = active.num_blocks * bs
        foreign = self._foreign_tokens(b, capacity_tokens)
        kv_free = kv_free_tokens(capacity_tokens, prompts + b.load.decode_tokens, foreign)
        revived = 0
        releases: list[tuple[float, float]] = []
        if request.num_prompt_tokens + request.max_tokens > kv_free:
            # A hit on blocks no running request pins takes them back out of the free pool
            # (the engine's admission counts them): only a hit on running prefixes is free.
            keys = request.block_hashes
            pinned = (len(keys) - active.num_new(keys)) * bs if prompts else 0
            revived = max(0, cached_tokens - pinned)
            need = kv_need_tokens(
                request.num_prompt_tokens, cached_tokens, request.max_tokens, revived
            )
            if need > kv_free:
                releases = self._kv_releases(b, bs, foreign)

        rate = b.rate.tokens_per_s
        own_s = estimate_ttft_s(
            num_prompt_tokens=request.num_prompt_tokens,
            cached_tokens=cached_tokens,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
            config=self.cost,
            kv_free_tokens=kv_free,
            decode_tokens=request.max_tokens,
            revived_tokens=revived,
            kv_releases=releases,
        )
        if not evicted:
            return Placement(own_s, own_s, 0, 0)
        with_evictions_s = own_s + eviction_cost_s(evicted * bs, hot * bs, rate, self.cost)
        return Placement(with_evictions_s, own_s, evicted, hot)
