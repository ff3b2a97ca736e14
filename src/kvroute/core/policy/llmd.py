"""A model of llm-d's inference scheduler (its Endpoint Picker) in its default profile.

Follows llm-d/llm-d-inference-scheduler at 520af47 (May 2026), where the Gateway API
Inference Extension's EPP code now lives, described in
``../shared/docs/anchors/llmd-gie-dynamo-aibrix.md`` (2.1-2.3, 3.1): the built-in profile
of ``pkg/epp/config/loader/defaults.go``, the ``approx-prefix-cache-producer``
(``.../requestcontrol/dataproducer/approximateprefix/``), the scorers ``prefix``,
``queuedepth``, ``kvcacheutilization`` and ``nohitlru`` and the ``maxscore`` picker
(``.../scheduling/{scorer,picker}/``):

- an approximate prefix index built from its own picks: per server an LRU of block hashes
  holding as many as the server's reported ``num_gpu_blocks`` (``autoTune``; else 31,250),
  a reverse map from hash to servers kept by the LRUs' eviction; after a pick the prompt's
  hashes are added to the chosen server's LRU in prompt order (so a prompt's head is its
  least recent entry, the first evicted); lookups do not refresh it;
- prefix score: walk the prompt's first 256 hashes while *some* server holds the hash,
  crediting every server that does (contiguity is not checked per server); a server's
  score is its credit / the prompt's blocks;
- queue score: the waiting queues min-max normalised, (max - q) / (max - min), 1.0 for
  every server when they are equal; KV-cache score: 1 - the engine's KV-cache usage;
- the profile's score is 3 x prefix + 2 x queue + 2 x KV-cache; the max-score picker
  shuffles the servers and takes the best (random tie-break);
- ``no_hit_lru_weight`` > 0 adds llm-d's no-hit-lru scorer: when no server has a hit for
  a request (cold), servers never sent a cold request score 1 - i / (n - 1) in order, then
  the others by how long ago they last were (least recent first, 1 - rank / (n - 1));
  a request with a hit gives every server 0.5. The policy ``llm-d-no-hit-lru`` is the
  default profile plus that scorer at weight 1.5: half the prefix weight, as in the
  scorer's README (10 and 5) and llm-d's ``deploy/config/sim-epp-no-hit-lru.yaml`` (2, 1).

Simplifications: the blocks are the router's keys (64 bytes of the prompt as the router
renders it in approximate mode, 16 tokens on KV events), where the EPP hashes 64-byte
blocks of the completion prompt or of the JSON of chat messages, and hashes a trailing
partial block too; the queue, KV usage and cache size are the router's last /metrics
scrape, which ``kvroute simulate`` takes every 50 ms for these models, as the EPP's
data layer does (``metrics_interval_s``; kvroute's own 2 s would make requests herd
between two scrapes onto the server that looked least busy and understate llm-d);
departed servers stay in the index (the EPP drops them every 2 minutes); the predicted
hit is the index's credit for the chosen server.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import ClassVar

from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Reason,
    RouteRequest,
    SeededPolicy,
    cached_tokens_for,
)


@dataclass(frozen=True, slots=True)
class LlmdParams:
    """The model's knobs (YAML ``policies.llm-d``): the profile's weights, the index's sizes."""

    SECTION: ClassVar[str] = "llm-d"

    prefix_weight: float = param(3.0, ge=0)  # prefix-cache-scorer
    queue_weight: float = param(2.0, ge=0)  # queue-scorer
    kv_cache_weight: float = param(2.0, ge=0)  # kv-cache-utilization-scorer
    no_hit_lru_weight: float = param(0.0, ge=0)  # no-hit-lru-scorer (0: not in the profile)
    max_prefix_blocks: int = param(256, ge=1)  # maxPrefixBlocksToMatch
    lru_capacity_per_server: int = param(31250, ge=1)  # hashes, without num_gpu_blocks
    auto_tune: bool = True  # size each server's LRU from its reported num_gpu_blocks
    no_hit_lru_size: int = param(1024, ge=1)  # servers the no-hit-lru scorer remembers

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class LlmdNoHitLruParams(LlmdParams):
    """``llm-d-no-hit-lru``: the default profile plus the no-hit-lru scorer (module doc)."""

    SECTION: ClassVar[str] = "llm-d-no-hit-lru"

    no_hit_lru_weight: float = param(1.5, ge=0)


class LlmdPolicy(SeededPolicy):
    """llm-d's default scheduling profile as the module docstring describes it."""

    name = "llm-d"
    metrics_interval_s = 0.05  # the EPP refreshes engine metrics every 50 ms
    Params: ClassVar[type[LlmdParams]] = LlmdParams

    def __init__(self, params: LlmdParams | None = None, *, rng: Random | None = None) -> None:
        super().__init__(rng=rng)
        self.p = params or self.Params()
        self._lrus: dict[str, OrderedDict[int, None]] = {}  # server -> hashes, LRU first
        self._capacity: dict[str, int] = {}  # server -> its LRU's size, fixed when made
        self._holders: dict[int, set[str]] = {}  # hash -> servers whose LRU holds it
        self._cold_lru: OrderedDict[str, None] = OrderedDict()  # cold picks, least recent first

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = list(view.candidates())
        if not urls:
            return None
        hashes = request.block_hashes[: self.p.max_prefix_blocks]
        credit = self._match(hashes)
        is_cold = not any(credit.get(u) for u in urls)
        scores = self._scores(urls, len(hashes), credit, is_cold, view)
        self.rng_for(view).shuffle(urls)
        urls.sort(key=lambda u: -scores[u])  # stable: equal scores stay shuffled
        url = urls[0]
        self._add(url, hashes, view)
        if is_cold and self.p.no_hit_lru_weight > 0:
            self._cold_lru[url] = None
            self._cold_lru.move_to_end(url)
            if len(self._cold_lru) > self.p.no_hit_lru_size:
                self._cold_lru.popitem(last=False)
        held = credit.get(url, 0)
        reason = Reason.PREFIX if held else Reason.COLD if is_cold else Reason.LOAD
        cached = cached_tokens_for(held, request.num_prompt_tokens, view.block_size)
        return Decision(url, reason, cached, tuple(urls))

    def _match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Blocks credited to each server: +1 per hash it holds, until one nobody holds."""
        credit: dict[str, int] = {}
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            for u in holders:
                credit[u] = credit.get(u, 0) + 1
        return credit

    def _scores(
        self,
        urls: Sequence[str],
        num_blocks: int,
        credit: Mapping[str, int],
        is_cold: bool,
        view: FleetView,
    ) -> dict[str, float]:
        p = self.p
        gauges = {u: view.engine_gauges(u) for u in urls}
        queue = {u: g.num_waiting or 0 for u, g in gauges.items()}
        lo, hi = min(queue.values()), max(queue.values())
        no_hit = self._no_hit_scores(urls, is_cold) if p.no_hit_lru_weight > 0 else {}
        scores = {}
        for u in urls:
            total = p.queue_weight * ((hi - queue[u]) / (hi - lo) if hi > lo else 1.0)
            total += p.kv_cache_weight * (1.0 - (gauges[u].kv_cache_usage or 0.0))
            total += p.prefix_weight * (credit.get(u, 0) / num_blocks if num_blocks else 0.0)
            scores[u] = total + p.no_hit_lru_weight * no_hit.get(u, 0.0)
        return scores

    def _no_hit_scores(self, urls: Sequence[str], is_cold: bool) -> dict[str, float]:
        """The no-hit-lru scorer: cold requests to servers least recently sent one."""
        n = len(urls)
        if not is_cold:
            return dict.fromkeys(urls, 0.5)
        if n == 1:
            return {urls[0]: 1.0}
        rank = {u: i for i, u in enumerate(self._cold_lru)}  # every remembered server
        never = [u for u in urls if u not in rank]
        scores = {u: 1.0 - i / (n - 1) for i, u in enumerate(never)}
        for u in urls:
            if u in rank:
                scores[u] = max(0.0, 1.0 - (len(never) + rank[u]) / (n - 1))
        return scores

    def _add(self, url: str, hashes: Sequence[int], view: FleetView) -> None:
        lru = self._lrus.get(url)
        if lru is None:
            lru = self._lrus[url] = OrderedDict()
            blocks = view.engine_gauges(url).num_gpu_blocks if self.p.auto_tune else None
            self._capacity[url] = blocks or self.p.lru_capacity_per_server
        capacity = self._capacity[url]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, set()).add(url)
            if len(lru) > capacity:
                old, _ = lru.popitem(last=False)
                holders = self._holders[old]
                holders.discard(url)
                if not holders:
                    del self._holders[old]

    def check_invariants(self) -> None:
        for h, holders in self._holders.items():
            assert holders, "llm-d index: a hash with no server"
            assert all(h in self._lrus[u] for u in holders), "llm-d index: holder without it"
        for url, lru in self._lrus.items():
            assert len(lru) <= self._capacity[url], "llm-d index: an LRU over its size"
            assert all(url in self._holders.get(h, ()) for h in lru), "llm-d index: one-way"


class LlmdNoHitLruPolicy(LlmdPolicy):
    """llm-d's default profile plus its no-hit-lru scorer (module doc)."""

    name = "llm-d-no-hit-lru"
    Params: ClassVar[type[LlmdParams]] = LlmdNoHitLruParams
