"""A model of DualMap (Yuan et al., ICLR 2026) as AIBrix's ``dualmap`` router, for the simulator.

Follows vllm-project/aibrix ``pkg/plugins/gateway/algorithms/dualmap.go`` (commit
9c8981e, 2026, its default balance type ``dualmap``) and the paper (arXiv 2602.06502),
summarised in ``../shared/docs/anchors/refresh-2026-11.md``:

- the request's prefix key is its first block (its first ``depth`` blocks once the prefix
  is hot); two independent hash functions map the key to two candidate backends (a
  collision takes the second function's next choice);
- of the two, the one whose cache holds more of the prompt; on a tie (a new prefix) the
  less loaded: power of two choices, per prefix;
- SLO switch: when the predicted TTFT on that choice exceeds ``ttft_slo_s``, the candidate
  with the lower predicted TTFT instead;
- hot-prefix expansion: the last ``hot_window`` requests are remembered with their
  prefix keys; a prefix used by at least ``hot_ratio`` of them (once ``hot_min_samples``
  are in) is keyed one block deeper from then on, so its requests, which differ further
  in, hash to more pairs and spread over more backends; a deepened prefix whose parent
  falls under ``shrink_ratio`` of the window is keyed at the parent again.

Defaults are AIBrix's: a window of 200 requests, 6.12 %, 20 samples, 2 %. AIBrix's
overload threshold is in tokens and defaults to 10^6 (never); this model takes the
paper's TTFT SLO, ``ttft_slo_s`` = 1 s, the P99 TTFT SLO of the simulator's planner
example (``kvroute simulate --plan --slo-ttft-p99 1``), since neither gives one in seconds.
Simplifications: the hash functions are rendezvous hashes (xxh3 under two seeds) instead
of AIBrix's two consistent-hash rings (xxhash and FNV, 100 virtual nodes); the cache
hit is kvroute's index (approximate or, in exact mode, KV events) rather than AIBrix's
own prefix table; load is in-flight tokens per weight (AIBrix's tie-break reads the
engine's KV usage); the predicted TTFT is kvroute's cost model (queued prefill plus
this request's uncached prefill at the learned rate, ``FleetView.placement``), AIBrix's
is pending tokens x a fixed time per token; the hotspot-aware rebalancing, which
migrates requests still queued in the router, is not modelled (a policy places, it
does not move; AIBrix's default thresholds, 10^6 tokens, leave it off too); the depth
walk (one block per hot request) is the paper's adaptive prefix length as AIBrix codes
it, its shrink step is this model's reading (AIBrix drops the current level's mark).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    cached_tokens_for,
    rendezvous_score,
    request_key,
    rest_by_load,
)

SECOND_SEED = 0x9E37_79B9_7F4A_7C15  # the second hash function: the key under another seed
MAX_DEEPENED = 4096  # deepened prefixes remembered at most (oldest forgotten first)


@dataclass(frozen=True, slots=True)
class DualMapParams:
    """The model's knobs (YAML ``policies.aibrix-dualmap``)."""

    SECTION: ClassVar[str] = "aibrix-dualmap"

    ttft_slo_s: float = param(1.0, gt=0)  # predicted TTFT above this: the faster candidate
    hot_window: int = param(200, ge=1)  # requests remembered for the hot-prefix share
    hot_ratio: float = param(0.0612, gt=0, le=1)  # share of the window that makes a prefix hot
    hot_min_samples: int = param(20, ge=1)  # requests in the window before any prefix is hot
    shrink_ratio: float = param(0.02, ge=0, le=1)  # parent's share under which it shrinks back

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class HotPrefixes:
    """How deep each prompt's prefix key goes: one block, one more per hot level.

    Block keys are chained (each names its whole prefix), so a prefix of ``d`` blocks is
    named by the key of its last block, ``hashes[d - 1]``. ``deepened`` holds the prefixes
    keyed one block deeper; the window counts, per prefix, the remembered requests whose
    key went through it.
    """

    __slots__ = ("counts", "deepened", "p", "window")

    def __init__(self, p: DualMapParams) -> None:
        self.p = p
        self.window: deque[Sequence[int]] = deque()  # each request's prefixes, oldest first
        self.counts: dict[int, int] = {}  # prefix -> requests in the window through it
        self.deepened: OrderedDict[int, None] = OrderedDict()

    def depth(self, hashes: Sequence[int]) -> int:
        """Blocks of ``hashes`` its key takes now (0 for a prompt under one block)."""
        d = min(1, len(hashes))
        while d < len(hashes) and hashes[d - 1] in self.deepened:
            d += 1
        return d

    def share(self, prefix: int) -> float:
        n = len(self.window)
        if n < self.p.hot_min_samples:
            return 0.0
        return self.counts.get(prefix, 0) / n

    def observe(self, hashes: Sequence[int], d: int) -> None:
        """Count a request keyed at depth ``d``; deepen its key if hot, shrink its parent
        if that has cooled."""
        path = hashes[:d]
        self.window.append(path)
        for h in path:
            self.counts[h] = self.counts.get(h, 0) + 1
        if len(self.window) > self.p.hot_window:
            for h in self.window.popleft():
                n = self.counts[h] - 1
                if n:
                    self.counts[h] = n
                else:
                    del self.counts[h]
        if 0 < d < len(hashes) and self.share(hashes[d - 1]) >= self.p.hot_ratio:
            self.deepened[hashes[d - 1]] = None
            if len(self.deepened) > MAX_DEEPENED:
                self.deepened.popitem(last=False)
        if d > 1 and self.share(hashes[d - 2]) < self.p.shrink_ratio:
            self.deepened.pop(hashes[d - 2], None)

    def check_invariants(self) -> None:
        assert len(self.window) <= self.p.hot_window, "window too long"
        counted: dict[int, int] = {}
        for path in self.window:
            for h in path:
                counted[h] = counted.get(h, 0) + 1
        assert counted == self.counts, "window counts"


class DualMapPolicy(Policy):
    """DualMap as AIBrix routes it, as the module docstring describes."""

    name = "aibrix-dualmap"
    Params = DualMapParams

    def __init__(self, params: DualMapParams | None = None) -> None:
        self.p = params or DualMapParams()
        self.hot = HotPrefixes(self.p)

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = view.candidates()
        if not urls:
            return None
        hashes = request.block_hashes
        d = self.hot.depth(hashes)
        key = hashes[d - 1] if d else request_key(request)
        self.hot.observe(hashes, d)
        pair = candidates(key, urls)
        held = {u: view.matched_blocks(u, hashes) for u in pair}
        cached = {
            u: cached_tokens_for(held[u], request.num_prompt_tokens, view.block_size) for u in pair
        }

        def load(u: str) -> float:
            lv = view.load(u)
            return lv.in_flight_tokens / lv.weight

        # the deeper hit; on a tie the less loaded; then the first hash's choice
        url = min(pair, key=lambda u: (-held[u], load(u), pair.index(u)))
        reason = Reason.PREFIX if held[url] else Reason.HASH
        ttft = {u: view.placement(u, request, cached[u]).own_ttft_s for u in pair}
        if ttft[url] > self.p.ttft_slo_s:
            faster = min(pair, key=lambda u: (ttft[u], pair.index(u)))
            if faster != url:
                url, reason = faster, Reason.LOAD
        ranked = rest_by_load(view, (url, *(u for u in pair if u != url)))
        return Decision(url, reason, cached[url], ranked, ttft[url])


def candidates(key: int, urls: Sequence[str]) -> tuple[str, ...]:
    """The two backends of ``key``: the best of ``urls`` under each of two hash functions
    (the second function's next best when both pick the same); one with one backend."""
    first = max(urls, key=lambda u: (rendezvous_score(key, u), u))
    if len(urls) == 1:
        return (first,)
    seed = key ^ SECOND_SEED
    second = max((u for u in urls if u != first), key=lambda u: (rendezvous_score(seed, u), u))
    return (first, second)
