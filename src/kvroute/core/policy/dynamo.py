"""A model of NVIDIA Dynamo's KV router (``--router-mode kv``), for the simulator.

Follows ai-dynamo/dynamo ``lib/llm/src/kv_router/`` as of 2026 (``DefaultWorkerSelector``
in the scheduling selector, ``ActiveSequences``, ``KvRouterConfig`` and the approximate
indexer), described in ``../shared/docs/anchors/llmd-gie-dynamo-aibrix.md`` (section 4):

- per worker, cost = ``overlap_score_weight`` x prefill blocks + decode blocks, where
  prefill blocks = (the worker's prefill tokens not yet done + this request's prompt
  tokens it does not cache) / block size, and decode blocks = the distinct blocks of the
  worker's active requests plus this request's blocks not among them (the router's own
  count: a prefix shared by active requests counts once, ``router_assume_kv_reuse``);
- ``router_temperature`` 0: the cheapest worker, ties to the smallest cache index (least
  cached state), then at random; above 0: a worker drawn with probability proportional
  to exp(-normalised cost / temperature), costs normalised by their spread;
- busy thresholds, off unless set: a worker whose active blocks exceed
  ``active_decode_blocks_threshold`` of its KV capacity, or whose prefill tokens not yet
  done exceed ``active_prefill_tokens_threshold``, is not a candidate; when every worker
  is busy the request is refused (Dynamo answers 529; here no decision, the simulator's
  "no backend");
- the overlap comes from one of Dynamo's two indexers, chosen by the router's mode, as
  ``use_kv_events`` chooses it in Dynamo. Event-driven (the default there): run the router
  in exact mode (``kvroute serve --policy dynamo --mode exact``; in the simulator
  ``--routers dynamo-exact``) and the overlap is the backend's cache read from its KV
  events (core/kv_sync.py), dispatches not yet confirmed by events included
  (kvroute's speculative entries, as Dynamo's optional ``--router-predicted-ttl-secs``).
  Approximate (``--no-router-kv-events``): run it in approximate mode (``--policy dynamo``;
  ``--routers dynamo``) and the policy keeps its own record of each decision's blocks
  per worker, each block for ``router_ttl_secs`` after the last request that routed it
  there; past ``router_max_tree_size`` blocks the soonest to expire go (tail blocks of a
  prompt before its head) until ``router_prune_target_ratio`` of the cap is left.

Defaults are Dynamo's ``KvRouterConfig::default()`` and CLI: 1.0, 0.0, 120 s, 2^20 blocks,
0.8; busy thresholds None (off). Simplifications: one block size (the router's key
blocks: 16 tokens on KV events, 64 characters of the rendered prompt in approximate
mode) and the overlap counts from the first block, not Dynamo's position-independent
content hashes in a radix tree; prefill tokens in flight are the router's count merged
with the engine's queue gauge (core/load.py), not the router's alone; no data-parallel
ranks, host or disk cache tiers, shared-cache credit, output-block tracking, replica
sync, admission queue (``--router-queue-threshold``) or session affinity; the prefill
busy threshold is in tokens only (not a fraction of ``max_num_batched_tokens``); a
block re-routed to a worker gets a new expiry but keeps its place among its prompt's.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random
from typing import ClassVar

from kvroute.common.hashing import leading_in
from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    cached_tokens_for,
)

RANKED_LIMIT = 8  # backends a decision lists for retries


@dataclass(frozen=True, slots=True)
class DynamoParams:
    """The model's knobs (YAML ``policies.dynamo``), Dynamo's names."""

    SECTION: ClassVar[str] = "dynamo"

    overlap_score_weight: float = param(1.0, ge=0)  # weight of the prefill blocks
    router_temperature: float = param(0.0, ge=0)  # 0: argmin; > 0: softmax sampling
    router_ttl_secs: float = param(120.0, gt=0)  # approximate indexer: a block's lifetime
    router_max_tree_size: int = param(1 << 20, ge=1)  # approximate indexer: blocks, all workers
    router_prune_target_ratio: float = param(0.8, ge=0, le=1)  # pruned down to this x the cap
    # busy when active blocks > this fraction of the KV capacity (None: never)
    active_decode_blocks_threshold: float | None = param(None, ge=0, le=1)
    # busy when prefill tokens in flight > this (None: never)
    active_prefill_tokens_threshold: int | None = param(None, ge=0)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class PredictedBlocks:
    """Dynamo's approximate indexer: each worker's blocks of the requests routed to it,
    each until ``ttl_s`` after it was last routed there.

    Per worker, an insertion-ordered map key -> expiry: every insertion carries the latest
    expiry, so the order is the expiry order and expiring pops from the front. A prompt is
    inserted tail first, so of blocks that expire together its tail goes first.

    A heap of the workers' first expiries finds what to expire or prune without a pass
    over the fleet per request (a 1,024-worker fleet made that the model's main cost).
    An entry is a lower bound of its worker's front (re-inserting the front block moves
    the front later) and is refreshed when reached; one entry per worker is live
    (``_scheduled``), older ones are skipped. Equal expiries go to the worker indexed
    first, as a scan in that order would.
    """

    __slots__ = ("_fronts", "_rank", "_scheduled", "max_blocks", "prune_ratio", "size",
                 "ttl_s", "url_to_keys")  # fmt: skip

    def __init__(self, ttl_s: float, max_blocks: int, prune_ratio: float) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.prune_ratio = prune_ratio
        self.url_to_keys: dict[str, OrderedDict[int, float]] = {}
        self.size = 0  # blocks over all workers
        self._fronts: list[tuple[float, int, str]] = []  # (front expiry at most, rank, url)
        self._scheduled: dict[str, float] = {}  # url -> expiry of its live heap entry
        self._rank: dict[str, int] = {}  # url -> its place in url_to_keys

    def expire(self, now: float) -> None:
        fronts = self._fronts
        while fronts and fronts[0][0] <= now:
            expiry, _, url = heapq.heappop(fronts)
            if self._scheduled.get(url) != expiry:
                continue  # superseded
            del self._scheduled[url]
            keys = self.url_to_keys[url]
            while keys and next(iter(keys.values())) <= now:
                keys.popitem(last=False)
                self.size -= 1
            self._schedule(url, keys)

    def matched(self, url: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` recorded for ``url``. A record holds a block only
        with its parent (a prompt's blocks are inserted together, tail first, and leave
        in that order), so they form a prefix of the chain: a binary search."""
        keys = self.url_to_keys.get(url)
        return leading_in(hashes, keys) if keys else 0

    def num_blocks(self, url: str) -> int:
        return len(self.url_to_keys.get(url, ()))

    def insert(self, url: str, hashes: Sequence[int], now: float) -> None:
        keys = self.url_to_keys.get(url)
        if keys is None:
            keys = self.url_to_keys[url] = OrderedDict()
            self._rank[url] = len(self._rank)
        expiry = now + self.ttl_s
        for h in reversed(hashes):
            if h in keys:
                keys.move_to_end(h)
            else:
                self.size += 1
            keys[h] = expiry
        if url not in self._scheduled:
            self._schedule(url, keys)
        if self.size > self.max_blocks:
            self._prune(int(self.max_blocks * self.prune_ratio))

    def _schedule(self, url: str, keys: OrderedDict[int, float]) -> None:
        if keys:
            front = next(iter(keys.values()))
            self._scheduled[url] = front
            heapq.heappush(self._fronts, (front, self._rank[url], url))

    def _prune(self, target: int) -> None:
        """Drop the soonest to expire, over all workers, until ``target`` blocks are left."""
        fronts = self._fronts
        while self.size > target and fronts:
            expiry, rank, url = fronts[0]
            keys = self.url_to_keys[url]
            if self._scheduled.get(url) != expiry:
                heapq.heappop(fronts)  # superseded
                continue
            front = next(iter(keys.values()))
            if front != expiry:  # the front moved later: refresh, then look again
                self._scheduled[url] = front
                heapq.heapreplace(fronts, (front, rank, url))
                continue
            keys.popitem(last=False)
            self.size -= 1
            heapq.heappop(fronts)
            del self._scheduled[url]
            self._schedule(url, keys)

    def check_invariants(self) -> None:
        assert self.size == sum(len(k) for k in self.url_to_keys.values()), "size"
        for url, keys in self.url_to_keys.items():
            expiries = list(keys.values())
            assert expiries == sorted(expiries), "expiry order"
            if keys:
                live = self._scheduled.get(url)
                assert live is not None and live <= expiries[0], "front not scheduled"
                assert (live, self._rank[url], url) in self._fronts, "live entry missing"


class DynamoPolicy(Policy):
    """NVIDIA Dynamo's KV routing as the module docstring describes it."""

    name = "dynamo"
    Params = DynamoParams
    active_blocks_stride = 1  # Dynamo counts every active block

    def __init__(self, params: DynamoParams | None = None, *, rng: Random | None = None) -> None:
        self.p = params or DynamoParams()
        self._has_busy_thresholds = (
            self.p.active_prefill_tokens_threshold is not None
            or self.p.active_decode_blocks_threshold is not None
        )
        self._rng = rng  # tests; else the fleet's
        self.predicted = PredictedBlocks(
            self.p.router_ttl_secs, self.p.router_max_tree_size, self.p.router_prune_target_ratio
        )

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = list(view.candidates())
        if self._has_busy_thresholds:  # off by default: then nobody is busy
            urls = [u for u in urls if not self._is_busy(u, view)]
        if not urls:
            return None
        self.predicted.expire(now)
        bs = view.block_size
        hashes = request.block_hashes
        isl = request.num_prompt_tokens
        exact = {u: view.cache_size(u).exact for u in urls}
        overlap: dict[str, int] = {}
        cost: dict[str, float] = {}
        for u in urls:
            held = view.matched_blocks(u, hashes) if exact[u] else self.predicted.matched(u, hashes)
            overlap[u] = held
            prefill_tokens = view.load(u).queued_prefill_tokens + max(0, isl - held * bs)
            decode_blocks = view.active_blocks(u, hashes)
            cost[u] = self.p.overlap_score_weight * prefill_tokens / bs + decode_blocks
        rng = self._rng if self._rng is not None else view.rng
        if self.p.router_temperature > 0:
            url = softmax_pick(urls, cost, self.p.router_temperature, rng)
        else:
            least = min(cost.values())
            tied = [u for u in urls if cost[u] == least]
            if len(tied) > 1:
                size = {u: self._tree_size(u, exact[u], view) for u in tied}
                smallest = min(size.values())
                tied = [u for u in tied if size[u] == smallest]
            url = tied[0] if len(tied) == 1 else rng.choice(tied)
        if not exact[url]:
            self.predicted.insert(url, hashes, now)
        held, deepest = overlap[url], max(overlap.values())
        if not deepest:
            reason = Reason.COLD
        elif held == deepest:
            reason = Reason.PREFIX
        else:
            reason = Reason.LOAD  # a deeper holder was dearer
        rest = sorted((u for u in urls if u != url), key=lambda u: cost[u])
        ranked = (url, *rest[: RANKED_LIMIT - 1])
        return Decision(url, reason, cached_tokens_for(held, isl, bs), ranked)

    def _is_busy(self, url: str, view: FleetView) -> bool:
        p = self.p
        prefill = p.active_prefill_tokens_threshold
        if prefill is not None and view.load(url).queued_prefill_tokens > prefill:
            return True
        if p.active_decode_blocks_threshold is not None:
            capacity = view.cache_size(url).capacity_blocks
            return view.active_blocks(url) > p.active_decode_blocks_threshold * capacity
        return False

    def _tree_size(self, url: str, exact: bool, view: FleetView) -> int:
        return view.cache_size(url).held_blocks if exact else self.predicted.num_blocks(url)


def softmax_pick(
    urls: Sequence[str], cost: dict[str, float], temperature: float, rng: Random
) -> str:
    """A URL drawn with probability ~ exp(-(cost - min) / (spread x temperature))
    (Dynamo's softmax over negated costs normalised by their spread; all equal: uniform)."""
    lo, hi = min(cost[u] for u in urls), max(cost[u] for u in urls)
    if hi == lo:
        return rng.choice(list(urls))
    scale = 1.0 / ((hi - lo) * temperature)
    weights = [math.exp(-(cost[u] - lo) * scale) for u in urls]
    return rng.choices(list(urls), weights=weights)[0]
