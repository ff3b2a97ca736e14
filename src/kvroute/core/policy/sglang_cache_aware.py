"""A model of SGLang's ``cache_aware`` router policy (also vllm-router's), for the simulator.

Follows SMG / sgl-model-gateway's ``policies/cache_aware.rs`` and ``kv_index``'s
``StringTree`` as of 2025-12 (sglang PR #14650), described in
``../shared/docs/anchors/sglang-vllm-ray-litellm.md`` (A.1):

- one approximate radix tree of every prompt routed, shared by the workers, each node
  remembering the worker that created it ("last tenant", set at creation and kept);
- per request: if the pool is imbalanced (max - min in-flight requests >
  ``balance_abs_threshold`` and max > ``balance_rel_threshold`` x min), the least loaded
  worker; else the longest match, and if it covers more than ``cache_threshold`` of the
  prompt, the creator of the deepest matched node (load is not consulted among holders);
  else, on a miss, the least loaded worker (``miss_to_smallest_tree``: the worker with the
  smallest tree, the rule before that PR and in older releases);
- the prompt is inserted under the chosen worker either way;
- every ``eviction_interval_s``, a worker whose tree holds more than ``max_tree_size``
  characters loses its least recently used leaves until it is under the cap.

Defaults are SMG's CLI: 0.3, 64, 1.5, 120 s, 2^26 characters. Simplifications: the tree
is kept at the router's key granularity (blocks of 64 characters of the rendered prompt
in approximate mode, of 16 tokens on KV events), not per character, and on the rendered
chat template rather than SGLang's concatenated message contents; the match rate is
matched blocks x block tokens / prompt tokens; LRU stamps move on every match (SMG: on 1
in 8); a worker whose tree node won but is no longer eligible falls back to the least
loaded. Load is as SMG counts it: the router's own in-flight requests (no engine gauge),
ties broken by the requests sent to each worker so far, then by order (SMG #1714).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.keys import CHARS_PER_TOKEN  # text keys cut block_size x 4 characters
from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    cached_tokens_for,
)


@dataclass(frozen=True, slots=True)
class SglangCacheAwareParams:
    """The model's knobs (YAML ``policies.sglang-cache-aware``), SGLang's names."""

    SECTION: ClassVar[str] = "sglang-cache-aware"

    cache_threshold: float = param(0.3, ge=0, le=1)
    balance_abs_threshold: int = param(64, ge=0)
    balance_rel_threshold: float = param(1.5, ge=1)
    eviction_interval_s: float = param(120.0, gt=0)
    max_tree_size: int = param(1 << 26, ge=1)  # characters per worker
    miss_to_smallest_tree: bool = False  # True: a miss goes to the smallest tree (pre-2025-12)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class SglangCacheAwarePolicy(Policy):
    """SGLang's cache-aware routing as the module docstring describes it."""

    name = "sglang-cache-aware"
    Params = SglangCacheAwareParams

    def __init__(self, params: SglangCacheAwareParams | None = None) -> None:
        self.p = params or SglangCacheAwareParams()
        self._creator: dict[int, str] = {}  # tree node (key) -> the worker that created it
        self._holders: dict[int, set[str]] = {}  # tree node -> workers whose tree has it
        self._trees: dict[str, OrderedDict[int, None]] = {}  # worker -> its nodes, LRU first
        self._next_eviction_s: float | None = None
        self._processed: dict[str, int] = {}  # worker -> requests sent to it (the tie-break)

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = list(view.candidates())
        if not urls:
            return None
        self._maybe_evict(now, view.block_size)
        loads = {u: view.load(u).own_in_flight_requests for u in urls}
        processed = self._processed
        # ties: fewer requests sent so far, then the first (SMG: by index)
        least = min(urls, key=lambda u: (loads[u], processed.get(u, 0)))
        hashes = request.block_hashes
        depth = 0
        if (
            max(loads.values()) - loads[least] > self.p.balance_abs_threshold
            and max(loads.values()) > self.p.balance_rel_threshold * loads[least]
        ):
            url, reason = least, Reason.LOAD
        else:
            creator = self._creator
            while depth < len(hashes) and hashes[depth] in creator:
                depth += 1
            rate = depth * view.block_size / max(1, request.num_prompt_tokens)
            owner = creator[hashes[depth - 1]] if depth else None
            if owner is not None and rate > self.p.cache_threshold and owner in loads:
                url, reason = owner, Reason.PREFIX
            elif self.p.miss_to_smallest_tree:
                url = min(urls, key=lambda u: len(self._trees.get(u, ())))
                reason = Reason.COLD
            else:
                url, reason = least, Reason.COLD
        self._insert(url, hashes)
        processed[url] = processed.get(url, 0) + 1
        held = depth if reason is Reason.PREFIX else self._held_by(url, hashes)
        cached = cached_tokens_for(held, request.num_prompt_tokens, view.block_size)
        ranked = (url, *sorted((u for u in urls if u != url), key=lambda u: loads[u]))
        return Decision(url, reason, cached, ranked)

    def _held_by(self, url: str, hashes: Sequence[int]) -> int:
        tree = self._trees.get(url)
        if tree is None:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, url: str, hashes: Sequence[int]) -> None:
        tree = self._trees.setdefault(url, OrderedDict())
        for h in reversed(hashes):
            # leaves first, so the path's root is the most recently used (evicted last)
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
                self._creator.setdefault(h, url)
                self._holders.setdefault(h, set()).add(url)

    def _maybe_evict(self, now: float, block_tokens: int) -> None:
        if self._next_eviction_s is None:
            self._next_eviction_s = now + self.p.eviction_interval_s
            return
        if now < self._next_eviction_s:
            return
        self._next_eviction_s = now + self.p.eviction_interval_s
        cap = max(1, self.p.max_tree_size // (block_tokens * CHARS_PER_TOKEN))
        for url, tree in self._trees.items():
            while len(tree) > cap:
                h, _ = tree.popitem(last=False)
                holders = self._holders[h]
                holders.discard(url)
                if not holders:
                    del self._holders[h], self._creator[h]
                elif self._creator[h] == url:
                    self._creator[h] = min(holders)  # the node stays, another worker's

    def check_invariants(self) -> None:
        assert set(self._creator) == set(self._holders), "creator and holders disagree"
        for h, holders in self._holders.items():
            assert holders and self._creator[h] in holders, "a node's creator left it"
            assert all(h in self._trees[u] for u in holders), "holder without the node"
