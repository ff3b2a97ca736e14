"""One backend as the Fleet keeps it: the live record, its counters, its snapshot.

The Fleet (core/fleet.py) decides which backends exist and moves requests between them;
what happens to one backend when a request is dispatched to it, reaches its first token
or ends, and when its engine's /metrics are scraped, depends on nothing else in the
fleet. That is this module: ``Backend`` (the mutable record, the Fleet's alone) with its
counters as named fields, and ``BackendState``, the frozen snapshot the status page,
/metrics and the tests read instead of the record.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvroute.core.cost import PrefillRate, work_tokens
from kvroute.core.event_model import EventCacheModel
from kvroute.core.keys import CHARS_PER_TOKEN
from kvroute.core.kv_sync import KvStream
from kvroute.core.load import ActiveBlocks, BackendLoad, Ticket, clamp_count
from kvroute.core.policy.base import RouteRequest
from kvroute.core.working_set import WorkingSet

MAX_BLOCK_SIZE = 1 << 16  # larger scraped or announced block sizes are not believed


def parse_block_size(value: object) -> int | None:
    """A block size an engine reported, or None when it is not a plausible one."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BLOCK_SIZE:
        return value
    return None


@dataclass(slots=True)
class PredictedHits:
    """The router's predictions at dispatch, summed over a backend's dispatched requests."""

    hit_tokens: int = 0  # predicted cached tokens
    query_tokens: int = 0  # prompt tokens


@dataclass(slots=True)
class ReportedHits:
    """The engine's own hits (usage.prompt_tokens_details.cached_tokens) beside the
    router's predictions, over the requests whose response reported them."""

    hit_tokens: int = 0  # reported cached tokens
    query_tokens: int = 0  # prompt tokens of the requests that reported
    predicted_tokens: int = 0  # predicted cached tokens of those requests
    num_requests: int = 0  # requests that reported
    num_exact: int = 0  # of which the prediction was exactly the report


@dataclass(slots=True)
class EngineCounters:
    """The engine's cumulative prefix-cache counters (vllm:prefix_cache_hits_total and
    _queries_total), summed as deltas since the first scrape: a counter that drops means
    the engine restarted, and its new value is then the delta."""

    last_hits: int | None = None  # last scraped value (None: never scraped)
    last_queries: int | None = None
    hit_tokens: int = 0  # sum of the deltas
    query_tokens: int = 0

    def observe(self, hits: int | None, queries: int | None) -> None:
        """One scrape (None: not reported)."""
        if hits is not None:
            hits = clamp_count(hits)
            self.hit_tokens += _delta(self.last_hits, hits)
            self.last_hits = hits
        if queries is not None:
            queries = clamp_count(queries)
            self.query_tokens += _delta(self.last_queries, queries)
            self.last_queries = queries


def _delta(last: int | None, value: int) -> int:
    if last is None:
        return 0
    return value - last if value >= last else value


@dataclass(frozen=True, slots=True)
class BackendState:
    """One backend as metrics and the status page see it (a snapshot)."""

    url: str  # backend URL
    models: tuple[str, ...]  # models it serves; () = unknown, treated as any
    weight: float  # relative capacity
    healthy: bool  # passes health checks
    draining: bool  # takes no new requests
    block_size: int  # tokens per engine block (scraped, else the default)
    capacity_blocks: int  # cache-model capacity (scraped num_gpu_blocks, else the default)
    in_flight_requests: int  # merged: max(ours, engine running + waiting)
    in_flight_tokens: int  # merged queued prefill + decode tokens
    queued_prefill_tokens: int  # merged uncached prompt tokens before first token
    engine_num_running: int | None  # last scraped gauge (None: never scraped)
    engine_num_waiting: int | None  # last scraped gauge
    kv_cache_usage: float | None  # last scraped vllm:kv_cache_usage_perc, 0..1
    index_blocks: int  # blocks the router's cache model holds for it
    prefill_tokens_per_s: float  # learned prefill rate
    rate_samples: int  # first tokens the rate has learned from
    predicted_hit_tokens: int  # sum of predicted cached tokens over dispatches
    predicted_query_tokens: int  # sum of prompt tokens over dispatches
    reported_hit_tokens: int  # sum of engine-reported cached_tokens (responses)
    reported_query_tokens: int  # prompt tokens of the requests that reported
    engine_hit_tokens: int  # delta of vllm:prefix_cache_hits_total since first scrape
    engine_query_tokens: int  # delta of vllm:prefix_cache_queries_total since first scrape
    num_dispatched: int  # requests dispatched
    num_failed: int  # requests finished with ok=False
    mode: str = "approximate"  # this backend's view: "exact" (KV events) or "approximate"
    kv_last_seq: int | None = None  # last applied KV event batch number (None: none yet)
    kv_lag_s: float | None = None  # receive time - engine timestamp of that batch
    kv_num_gaps: int = 0  # sequence gaps found in its event stream
    kv_num_restarts: int = 0  # engine restarts seen in its event stream
    kv_num_events: int = 0  # KV events applied
    speculative_blocks: int = 0  # exact mode: dispatched keys not yet confirmed by events
    own_in_flight_requests: int = 0  # the router's own dispatched, unfinished requests
    reported_predicted_tokens: int = 0  # predicted cached tokens of the requests that reported
    num_reported: int = 0  # requests whose engine reported cached_tokens
    num_reported_exact: int = 0  # of which the router's prediction was exactly the report
    # approximate mode: learned UTF-8 bytes of prompt text per engine token of its models
    # (4.0, the built-in tokenizer's, until learned) and its cache model's capacity in
    # key blocks (capacity_blocks x bytes_per_token / 4)
    bytes_per_token: float = float(CHARS_PER_TOKEN)
    key_capacity_blocks: int = 0
    # key blocks its requests reused within its cache's last turnover (its working set,
    # core/working_set.py; evicting them costs more than evicting others)
    hot_blocks: int = 0


class Backend:
    """A backend's live record: membership flags, engine gauges, load, rate, counters."""

    __slots__ = (
        "active_blocks",
        "block_size",
        "draining",
        "engine",
        "epoch",
        "foreign_requests",
        "healthy",
        "kv_cache_usage",
        "load",
        "models",
        "num_dispatched",
        "num_failed",
        "num_gpu_blocks",
        "open_tickets",
        "predicted",
        "rate",
        "reported",
        "tiebreak",
        "url",
        "weight",
        "working_set",
    )

    def __init__(
        self,
        url: str,
        epoch: int,
        models: Iterable[str],
        weight: float,
        fleet_rate: PrefillRate,
        active_blocks_stride: int = 1,
    ) -> None:
        self.url = url
        self.epoch = epoch  # tells this membership's tickets from a removed namesake's
        self.models = frozenset(models)
        self.weight = weight
        self.healthy = True
        self.draining = False
        self.block_size: int | None = None  # scraped or announced; None: the default
        self.num_gpu_blocks: int | None = None  # scraped; None: the default
        self.kv_cache_usage: float | None = None  # last scraped gauge, 0..1
        # the engine's requests at the last scrape that ours did not explain (other
        # routers' or clients'): what of its gauges still holds once ours of that moment
        # have ended (foreign_kv_share)
        self.foreign_requests = 0
        self.load = BackendLoad()
        # the keys of its open tickets (shared once): the KV our requests pin (cost.py)
        self.active_blocks = ActiveBlocks(active_blocks_stride)
        # the fleet's rate x weight x an offset learned from its own first tokens (cost.py)
        self.rate = PrefillRate(fleet_rate.config, reference=fleet_rate, scale=weight)
        self.open_tickets: dict[int, Ticket] = {}
        self.predicted = PredictedHits()
        self.reported = ReportedHits()
        self.engine = EngineCounters()
        self.num_dispatched = 0
        self.num_failed = 0
        self.tiebreak = xxhash.xxh3_64_intdigest(url.encode())  # load-order ties
        self.working_set = WorkingSet()  # blocks its requests reuse (the eviction cost)

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    @property
    def is_orderable(self) -> bool:
        return self.healthy and not self.draining

    # -- engine metrics ----------------------------------------------------------------

    def observe_engine(
        self,
        num_running: int | None,
        num_waiting: int | None,
        kv_cache_usage: float | None,
        block_size: int | None,
        num_gpu_blocks: int | None,
    ) -> tuple[bool, bool]:
        """One scrape's gauges (None = not reported); (block size changed, engine
        capacity reported): the Fleet's per-model caches and cache model follow them."""
        self.load.observe_engine(num_running, num_waiting)
        if num_running is not None or num_waiting is not None:
            self.foreign_requests = max(0, self._engine_requests() - self.load.in_flight_requests)
        if kv_cache_usage is not None:
            # compared, not converted: nan is 0, an int too big for a float is 1
            u = kv_cache_usage
            self.kv_cache_usage = 1.0 if u > 1 else float(u) if u > 0 else 0.0
        size = parse_block_size(block_size)
        size_changed = size is not None and size != self.block_size
        if size_changed:
            self.block_size = size
        if num_gpu_blocks is not None and num_gpu_blocks >= 1:
            self.num_gpu_blocks = clamp_count(num_gpu_blocks)
            return size_changed, True
        return size_changed, False

    def _engine_requests(self) -> int:
        return (self.load.engine_num_running or 0) + (self.load.engine_num_waiting or 0)

    @property
    def foreign_kv_share(self) -> float:
        """The share of the scraped KV usage that requests we did not send held then:
        their share of the engine's requests at that scrape (all of it when the engine
        reports usage without request counts)."""
        load = self.load
        if load.engine_num_running is None and load.engine_num_waiting is None:
            return 1.0
        engine = self._engine_requests()
        return self.foreign_requests / engine if engine else 0.0

    def forget_engine_gauges(self) -> None:
        """A dead engine's last queue and KV usage must not count (the next scrape after
        recovery refills them)."""
        self.load.engine_num_running = self.load.engine_num_waiting = None
        self.kv_cache_usage = None
        self.foreign_requests = 0

    # -- requests ----------------------------------------------------------------------

    def ticket(self, ticket_id: int, req: RouteRequest, cached_tokens: int, now: float) -> Ticket:
        """A ticket for ``req`` dispatched here at ``now``, ``cached_tokens`` of it predicted
        to hit (nothing is counted until ``acquire``)."""
        return Ticket(
            ticket_id=ticket_id,
            url=self.url,
            request_id=req.request_id,
            epoch=self.epoch,
            dispatched_at_s=now,
            num_prompt_tokens=req.num_prompt_tokens,
            uncached_tokens=max(0, req.num_prompt_tokens - cached_tokens),
            decode_tokens=req.max_tokens,
            predicted_cached_tokens=cached_tokens,
            queued_ahead_tokens=self.load.queued_prefill_tokens,
            block_hashes=req.block_hashes,
        )

    def acquire(self, ticket: Ticket, means: tuple[float, float]) -> None:
        """Count a dispatched request (``means``: the load's after it, load.means_after)."""
        self.load.acquire(ticket, means)
        self.open_tickets[ticket.ticket_id] = ticket
        self.active_blocks.add(ticket.block_hashes)
        self.predicted.hit_tokens += ticket.predicted_cached_tokens
        self.predicted.query_tokens += ticket.num_prompt_tokens
        self.num_dispatched += 1

    def unacquire(self, ticket: Ticket, means: tuple[float, float]) -> None:
        """Take back ``acquire`` (``means``: the load's before it)."""
        self.load.unacquire(ticket, means)
        del self.open_tickets[ticket.ticket_id]
        self.active_blocks.remove(ticket.block_hashes)
        self.predicted.hit_tokens -= ticket.predicted_cached_tokens
        self.predicted.query_tokens -= ticket.num_prompt_tokens
        self.num_dispatched -= 1

    def first_token(
        self, ticket: Ticket, now: float, cached_tokens: int | None, fleet_rate: PrefillRate
    ) -> None:
        """``ticket``'s prefill is done: its queued prefill is released, the engine's
        report of its hit (if any) recorded, and this backend's rate and the fleet's (per
        unit of weight) learn from the work its first token waited for (cost.py)."""
        self.load.release_prefill(ticket)
        cached = ticket.predicted_cached_tokens
        if cached_tokens is not None:
            self.record_reported(ticket, cached_tokens)
            cached = ticket.reported_cached_tokens or 0
        uncached = max(0, ticket.num_prompt_tokens - cached)
        work = ticket.queued_ahead_tokens + work_tokens(uncached, cached, fleet_rate.config)
        self.rate.observe(work, now - ticket.dispatched_at_s)
        fleet_rate.observe(work / self.weight, now - ticket.dispatched_at_s)

    def learn_reuse(self, keys: Sequence[int], num_held: int, window: int, share: int) -> None:
        """The working set learns a dispatch of ``keys``, ``num_held`` of them cached here:
        its window is ``window`` (the cache model's capacity: one turnover); its size at
        most 4 x that (room for the ghosts of a working set larger than the cache) and at
        most ``share`` (the index's cap over the backends, so all together stay under it)."""
        num_added = max(0, min(len(keys), window) - num_held)
        self.working_set.touch(keys, num_added, window, max(1, min(4 * window, share)))

    def release(self, ticket: Ticket, ok: bool) -> None:
        """The request ended (its ticket is open here)."""
        self.load.release(ticket)
        del self.open_tickets[ticket.ticket_id]
        self.active_blocks.remove(ticket.block_hashes)
        if not ok:
            self.num_failed += 1

    def record_reported(self, ticket: Ticket, cached_tokens: int) -> None:
        """The engine's cached tokens for ``ticket`` (only its first report counts)."""
        if ticket.reported_cached_tokens is not None:
            return
        cached = min(clamp_count(cached_tokens), ticket.num_prompt_tokens)
        ticket.reported_cached_tokens = cached
        r = self.reported
        r.hit_tokens += cached
        r.query_tokens += ticket.num_prompt_tokens
        r.predicted_tokens += ticket.predicted_cached_tokens
        r.num_requests += 1
        r.num_exact += cached == ticket.predicted_cached_tokens

    # -- reporting ---------------------------------------------------------------------

    def state(
        self,
        *,
        block_size: int,
        capacity_blocks: int,
        index_blocks: int,
        stream: KvStream,
        exact: EventCacheModel | None,
        bytes_per_token: float,
        key_capacity_blocks: int,
    ) -> BackendState:
        """The snapshot, with what the Fleet knows of it: its block size and capacity as
        routing uses them, its cache model's size, its KV event stream, its exact view
        (None: approximate), its text calibration and capacity in key blocks."""
        load = self.load
        return BackendState(
            url=self.url,
            models=tuple(sorted(self.models)),
            weight=self.weight,
            healthy=self.healthy,
            draining=self.draining,
            block_size=block_size,
            capacity_blocks=capacity_blocks,
            in_flight_requests=load.requests,
            in_flight_tokens=load.in_flight_tokens,
            queued_prefill_tokens=load.queued_prefill_tokens,
            engine_num_running=load.engine_num_running,
            engine_num_waiting=load.engine_num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            index_blocks=index_blocks,
            prefill_tokens_per_s=self.rate.tokens_per_s,
            rate_samples=self.rate.num_samples,
            predicted_hit_tokens=self.predicted.hit_tokens,
            predicted_query_tokens=self.predicted.query_tokens,
            reported_hit_tokens=self.reported.hit_tokens,
            reported_query_tokens=self.reported.query_tokens,
            engine_hit_tokens=self.engine.hit_tokens,
            engine_query_tokens=self.engine.query_tokens,
            num_dispatched=self.num_dispatched,
            num_failed=self.num_failed,
            mode="exact" if exact is not None else "approximate",
            kv_last_seq=stream.last_seq if stream.last_seq >= 0 else None,
            kv_lag_s=stream.lag_s,
            kv_num_gaps=stream.num_gaps,
            kv_num_restarts=stream.num_restarts,
            kv_num_events=stream.num_events,
            speculative_blocks=exact.num_speculative if exact is not None else 0,
            own_in_flight_requests=load.in_flight_requests,
            reported_predicted_tokens=self.reported.predicted_tokens,
            num_reported=self.reported.num_requests,
            num_reported_exact=self.reported.num_exact,
            bytes_per_token=bytes_per_token,
            key_capacity_blocks=key_capacity_blocks,
            hot_blocks=self.working_set.num_hot,
        )

    def check_invariants(self) -> None:
        """Load, working set and open tickets agree."""
        self.load.check_invariants()
        self.working_set.check_invariants()
        tickets = self.open_tickets.values()
        load = self.load
        assert load.in_flight_requests == len(tickets), "fleet: requests != open tickets"
        assert load.decode_tokens == sum(t.decode_tokens for t in tickets), "fleet: decode"
        queued = sum(t.uncached_tokens for t in tickets if not t.is_prefill_released)
        assert load.queued_prefill_tokens_ours == queued, "fleet: queued prefill"
        stride = self.active_blocks.stride
        union = {k for t in tickets for k in t.block_hashes[::stride]}
        assert set(self.active_blocks.key_to_count) == union, "fleet: active blocks"
