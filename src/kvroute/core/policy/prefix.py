"""The kvroute policy: the backend with the lowest estimated TTFT, cache hits included."""

from __future__ import annotations

from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    RouteRequest,
    cached_tokens_for,
    rendezvous_score,
    rest_by_load,
)


class PrefixPolicy(Policy):
    """Send each request where its time to first token is lowest, counting cached prefixes.

    What it does: the candidates are the holders of the request's deepest cached prefix
    (up to ``max_holders``, least loaded first, then shallower holders), the
    ``num_least_loaded`` least-loaded eligible backends, and ``num_hashed`` "homes" picked
    by hashing the first uncached block over the eligible backends (so new prefixes are
    spread over the whole fleet's cache even when many backends are equally idle, and
    every router process picks the same homes). Each is scored by the cost model:
    queued prefill ahead / its learned prefill rate + this request's uncached work / that
    rate (+ attention, KV pressure, overhead), in seconds. The minimum wins; exact ties go
    to the highest rendezvous hash of (first uncached block key, URL), so independent
    router processes make the same choice. Reason: "prefix" when the winner has the
    deepest match, "load" when a holder existed but another backend was cheaper, "cold"
    when nobody holds any block. The prediction is the matched whole blocks within
    prompt - 1 (``cached_tokens_for``: what the engine will report).

    When it loses: a hot prefix first lives on one backend; as that backend's queue grows
    the cost rule sends overflow to a least-loaded backend where recomputing is faster,
    which then becomes a second holder, and among holders the cheapest wins, so a prefix
    spreads to as many backends as its demand needs (not more). It still loses when the
    cache model is wrong (engine evicted earlier than the LRU model thinks; exact mode
    fixes that), and to a clairvoyant scheduler on bursts of long cold prompts, since it
    decides per request and never delays one.

    Inputs: index (holders, match depth), load (queued prefill tokens), cost (rates).
    Knobs: ``num_least_loaded`` (3), ``max_holders`` (4), ``num_hashed`` (2),
    ``ranked_limit`` (8).
    """

    name = "prefix"

    def __init__(
        self,
        *,
        num_least_loaded: int = 3,
        max_holders: int = 4,
        num_hashed: int = 2,
        ranked_limit: int = 8,
    ) -> None:
        if num_least_loaded < 1 or max_holders < 1 or ranked_limit < 1 or num_hashed < 0:
            raise ValueError(
                "prefix: num_least_loaded, max_holders, ranked_limit must be >= 1, num_hashed >= 0"
            )
        self.num_least_loaded = num_least_loaded
        self.max_holders = max_holders
        self.num_hashed = num_hashed
        self.ranked_limit = ranked_limit

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        hashes = request.block_hashes
        url_to_depth = dict(view.match(hashes, self.max_holders))
        deepest = max(url_to_depth.values(), default=0)
        tie_key = int(hashes[min(deepest, len(hashes) - 1)]) if hashes else 0
        for url in (*view.least_loaded(self.num_least_loaded), *self._homes(view, tie_key)):
            if url not in url_to_depth:
                url_to_depth[url] = view.matched_blocks(url, hashes) if deepest else 0
        if not url_to_depth:
            return None
        scored = []
        for url, depth in url_to_depth.items():
            cached = cached_tokens_for(depth, request.num_prompt_tokens, view.block_size)
            ttft_s = view.estimate_ttft_s(url, request, cached)
            scored.append((round(ttft_s, 9), -rendezvous_score(tie_key, url), url, cached))
        scored.sort()
        ttft_s, _, best, cached = scored[0]
        if deepest == 0:
            reason = "cold"
        elif url_to_depth[best] == deepest:
            reason = "prefix"
        else:
            reason = "load"
        ranked = rest_by_load(view, [s[2] for s in scored], self.ranked_limit)
        return Decision(best, reason, cached, ranked, ttft_s)

    def _homes(self, view: FleetView, tie_key: int) -> list[str]:
        """``num_hashed`` backends picked by slices of ``tie_key`` (O(1), same everywhere)."""
        eligible = view.candidates()
        if not eligible:
            return []
        return [eligible[(tie_key >> (16 * j)) % len(eligible)] for j in range(self.num_hashed)]
