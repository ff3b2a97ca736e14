"""The kvroute policy: the backend with the lowest estimated TTFT, cache hits included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.cost import CostConfig, diversion_margin_s
from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    cached_tokens_for,
    rendezvous_score,
    rest_by_load,
)

Scored = tuple[float, int, str, int]  # (TTFT estimate s, -rendezvous score, url, cached tokens)


@dataclass(frozen=True, slots=True)
class PrefixParams:
    """The prefix policy's knobs (YAML ``policies.prefix``; the margin's are ``fleet.cost``)."""

    SECTION: ClassVar[str] = "prefix"

    num_least_loaded: int = param(3, ge=1)  # least-loaded backends added as candidates
    max_holders: int = param(4, ge=1)  # holders of the deepest match considered
    num_hashed: int = param(2, ge=0)  # "homes" hashed from the first uncached block
    ranked_limit: int = param(8, ge=1)  # backends in Decision.ranked (retries walk it)
    # False: a request always goes to the holder of its deepest match, however busy (the
    # hit rate of a fleet that holds every prefix in one place, with the queues that builds)
    divert: bool = True

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class PrefixPolicy(Policy):
    """Send each request where its time to first token is lowest, counting cached prefixes,
    and leave the holder of its prefix only for a clear gain.

    What it does: the candidates are the holders of the request's deepest cached prefix
    (up to ``max_holders``, least loaded first, then shallower holders), the
    ``num_least_loaded`` least-loaded eligible backends, and ``num_hashed`` "homes" picked
    by hashing the first uncached block over the eligible backends (so new prefixes are
    spread over the whole fleet's cache even when many backends are equally idle, and
    every router process picks the same homes). Each is scored by the cost model:
    queued prefill ahead / its learned prefill rate + this request's uncached work / that
    rate (+ attention, KV pressure, overhead), in seconds, plus the recompute its new
    blocks cause later by evicting others: dear when they push out the backend's working
    set of reused blocks, cheap when they push out leftovers (core/cost.py).

    With no holder ("cold"), the candidates are those whose own TTFT (queue and prefill,
    without the eviction term) is within the diversion margin of the fastest. A new
    prefix goes to the cheapest of them with room for it; when every cache is full, to
    one where it evicts only blocks nobody reused, if any; and among those, to the one
    whose cache turns over slowest (core/turnover.py). Why not the cheapest estimate:
    under cache pressure the estimates differ by momentary queues and eviction
    snapshots, so cold prompts arrive in runs on whichever backend looks cheapest now,
    its cache churns faster than the others and its prefixes die before their reuse;
    spreading the additions so every cache turns over alike keeps each prefix longest
    (gsp on the HTTP rig, 3 seeds: 38.7 -> 39.7 % hit, P99 TTFT 1,256 -> 805 ms;
    BENCHMARKS.md, "Cache pressure"). With holders, the holder of the deepest match is
    the home ("prefix"); among several, chosen as a cold prompt's backend is, for the
    same reason: a shared head (an app's system prompt, held everywhere) followed by a
    new conversation is a new prefix whose placement decides whose context it evicts
    (multiturn in the simulator, 3 seeds: 82.9 -> 84.3 % hit, P99 510 -> 397 ms, where
    the cheapest holder piled conversations onto momentarily short queues). If the
    home's hit is less than
    ``divert_min_cached_share`` (half) of the prompt, the request is mostly new and the
    cheapest candidate wins ("new": not a diversion, whatever it leaves): where its new
    blocks go (and what they evict) matters more than the short shared head. Cost, not
    the cold rule, because these prompts (new conversations) are most of what a fleet
    adds under cache pressure, and where the reuse lies mostly past the caches' residency
    piling them where they evict least keeps the other caches' contexts long enough to
    be reused (the Mooncake slice: 5.0 % against 4.4 % spread). Except where the fleet's
    reuse crowds just inside that residency (``FleetView.reuse_concave``,
    core/reuse_regime.py) and the head is held in several places (an app's system
    prompt, not the request's own half-evicted context): then it goes where a cold
    prompt would, since even residency keeps the most there (the whole Mooncake trace,
    whose every request starts with one shared block, in the simulator on
    llama-3.1-8b: 8 backends 21.4 -> 22.9 % hit over 3 seeds, 16 backends 29.6 -> 31.3 %,
    exact mode 21.7 -> 23.0 %; the seven workloads of BENCHMARKS.md's table unchanged but
    agentic, 0.3 points lower). There too, a head its home alone holds (the request's own
    context, half evicted) is not placed on cost but charged as a diversion, below: what
    comes back there comes back before the cache drops it, so the rest of that context
    is worth keeping in one place (the same trace, seeds 0-1: 22.9 -> 23.2 %). Otherwise
    another candidate wins
    instead of the home ("load") only if its estimate, plus ``divert_recompute_share`` x
    the recompute the move causes there (its estimate minus its estimate with the home's
    hit: the prefix it prefills again, and the cache that evicts), is below the home's by
    max(``divert_margin_s``, ``divert_margin_fraction`` x the home's estimate). Why:
    - the recompute is counted twice, once in the request's own estimate and once for
      whoever queues behind it on the target (the fleet does that much more prefill than
      on the home), so a diversion must pay for what it costs others, not only be faster
      for itself (issue 11 saw the spiral of the rule without it: each diversion
      recomputed a long prompt, queued more prefill, made holders look busier, and more
      requests were diverted);
    - except for a shared head copied into room: the part of the home's hit that
      requests running there also use (an app's system prompt, not this request's own
      context) is in demand, and copying it into a cache where it evicts nothing reused
      spreads it, as the next paragraph says a hot prefix should; only the rest of the
      hit is charged. Charging it too kept an app's conversations piled, early in a run,
      on the few replicas that first held its system prompt, until their contexts
      outgrew those caches (multiturn in the simulator, 5 seeds: 84.2 -> 85.4 % hit,
      P99 435 -> 310 ms). Charging nothing for copies into room also moved long private
      contexts into empty caches (agentic on 64 backends: 88.2 -> 85.2 %; reverted);
    - under pressure a recompute costs more than one queue's wait: with no idle backend
      the work a move adds is work nobody can absorb, and every request queued after it
      waits for it. So the share grows with the share of the candidates that have
      prefill queued (``divert_pressure_gain`` 1.0: twice when none is idle; the
      candidates include the least-loaded backends, so that means the whole fleet), and
      with none idle a mostly new request is charged like the rest instead of placed on
      cost alone (leaving the part of its context its home holds recomputes it on a
      fleet with no room). Without it exact mode spiralled in overload: the index shows
      what the preempting engines really kept, homes' hits look small, moves look cheap,
      and each one adds a long prefill where there is no room (agent sessions past the
      fleet's capacity, 5 seeds in the simulator: exact 88.0 -> 89.3 % hit, P99 TTFT
      56 -> 21 s; approximate 89.4 -> 89.5 %, 14 -> 12 s; BENCHMARKS.md's seven
      workloads unchanged within 0.2 points, since they seldom queue everywhere);
    - 50 ms: TTFTs and queue snapshots jitter by a few tens of ms (a scrape, a GC pause,
      a batch boundary); a smaller margin flips decisions on noise;
    - 20 % of the home's estimate: the learned rate's error (a burst of outliers moves it
      by up to ~8 %, cost.PrefillRate) and the queue's drift while the request waits scale
      with the estimate, so the margin does too.
    A session hint (``RouteRequest.session``: the client's session header or ``user``)
    joins the candidates with the backend the session's last request went to, if that one
    is eligible. It breaks ties only: when it holds the deepest match as another holder
    does (the session's harness prompt on every backend while the cache model has let the
    session's own context go), it is the home ("session"), and the diversion rule above
    still applies, so the cost model can move a session whose home got too busy. It never
    outranks a deeper match elsewhere: the index knows where the context is, the hint only
    where it was sent.
    Among candidates worth diverting to, the lowest charged estimate wins, then the deeper
    match. Exact ties go to the highest rendezvous hash of (first uncached block key, URL),
    so independent router processes make the same choice. The prediction is the matched
    whole blocks within prompt - 1 (``cached_tokens_for``: what the engine will report).

    When it loses: a hot prefix first lives on one backend; once that backend's queue
    exceeds the alternatives' by the recompute (twice) and the margin, overflow goes to a
    least-loaded backend, which then becomes a second holder, and among holders the
    cheapest wins, so a prefix spreads to as many backends as its demand needs (not more),
    later than a rule without margin would (its holders run up to ~2 recomputes + the margin
    busier). It still loses when the cache model is wrong (engine evicted earlier than the
    LRU model thinks; exact mode fixes that), and to a clairvoyant scheduler on bursts of
    long cold prompts, since it decides per request and never delays one.

    Inputs: index (holders, match depth), load (queued prefill tokens), cost (rates, the
    backends' working sets, the margin's knobs in ``CostConfig``). Knobs (``PrefixParams``):
    ``num_least_loaded`` (3), ``max_holders`` (4), ``num_hashed`` (2), ``ranked_limit`` (8),
    ``divert`` (True; False never leaves the holder, for fleets that want hits over tails).
    A request moved away from its home (``load``, ``new``) carries the part of the home's
    predicted hit its target lacks as ``Decision.left_cached_tokens``: what the move gave
    up (a shared head both hold is not).
    """

    name = "prefix"
    Params = PrefixParams

    def __init__(self, params: PrefixParams | None = None) -> None:
        params = params or PrefixParams()
        self.num_least_loaded = params.num_least_loaded
        self.max_holders = params.max_holders
        self.num_hashed = params.num_hashed
        self.ranked_limit = params.ranked_limit
        self.divert = params.divert

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        hashes = request.block_hashes
        url_to_depth = dict(view.match(hashes, self.max_holders))
        deepest = max(url_to_depth.values(), default=0)
        tie_key = int(hashes[min(deepest, len(hashes) - 1)]) if hashes else 0
        session_url = view.session_backend(request.session)
        extra = view.least_loaded(self.num_least_loaded) + self._homes(view, tie_key)
        if session_url is not None:
            extra.append(session_url)
        for url in extra:
            if url not in url_to_depth:
                url_to_depth[url] = view.matched_blocks(url, hashes) if deepest else 0
        if not url_to_depth:
            return None
        scored: list[Scored] = []
        for url, depth in url_to_depth.items():
            cached = cached_tokens_for(depth, request.num_prompt_tokens, view.block_size)
            ttft_s = view.estimate_ttft_s(url, request, cached)
            scored.append((round(ttft_s, 9), -rendezvous_score(tie_key, url), url, cached))
        scored.sort()
        best, reason, left = scored[0], Reason.COLD, 0
        if not deepest:
            best = self._cold(request, view, scored)
        else:
            holders = [s for s in scored if url_to_depth[s[2]] == deepest]
            best = holders[0] if len(holders) == 1 else self._cold(request, view, holders)
            home_reason = Reason.PREFIX
            if session_url not in (None, best[2]) and url_to_depth[session_url] == deepest:
                best = next(s for s in scored if s[2] == session_url)  # a tie it breaks
                home_reason = Reason.SESSION
            reason = home_reason
            shared = len(holders) > 1
            moved = (
                self._away(request, view, best, scored, url_to_depth, shared)
                if self.divert
                else None
            )
            if moved is not None:
                left = max(0, best[3] - moved[0][3])  # the home's hit the target lacks
                best, reason = moved
        ttft_s, _, url, cached = best
        first = [url, *(s[2] for s in scored if s[2] != url)]
        ranked = rest_by_load(view, first, self.ranked_limit)
        return Decision(url, reason, cached, ranked, ttft_s, left_cached_tokens=left)

    @staticmethod
    def _cold(request: RouteRequest, view: FleetView, scored: list[Scored]) -> Scored:
        """Where a prompt no backend holds goes (class docstring). Among the candidates
        whose own TTFT is within the diversion margin of the fastest: those with room for
        it (it evicts nothing) by cost; else those where it evicts only blocks nobody
        reused, else all of them, by how slowly their caches turn over; ties by the
        estimate, then the rendezvous hash."""
        at = {s[2]: view.placement(s[2], request, s[3]) for s in scored}
        fastest_s = min(p.own_ttft_s for p in at.values())
        bar_s = fastest_s + diversion_margin_s(fastest_s, view.cost)
        fit = [s for s in scored if at[s[2]].own_ttft_s <= bar_s]
        room = [s for s in fit if not at[s[2]].evicted_blocks]
        if room:
            return room[0]
        spare = [s for s in fit if not at[s[2]].hot_blocks]
        return min(spare or fit, key=lambda s: (round(view.cache_turnover(s[2]), 9), s))

    @staticmethod
    def _away(
        request: RouteRequest,
        view: FleetView,
        home: Scored,
        scored: list[Scored],
        url_to_depth: dict[str, int],
        shared_head: bool,
    ) -> tuple[Scored, Reason] | None:
        """Where the request goes instead of ``home``, and why, or None: a mostly new one
        to the cheapest candidate, or, where the fleet's reuse says spread, where a cold
        prompt would go if its head is held in several places ("new"); else (its own
        context, half evicted, where the reuse says spread) a diversion worth its charge
        ("load")."""
        own_context = view.reuse_concave and not shared_head  # charged, never on cost
        if not own_context and _new_on_cost(request, view, home, scored):
            # where reuse says spread, this is a shared head: placed as a cold prompt is
            to = PrefixPolicy._cold(request, view, scored) if view.reuse_concave else scored[0]
            return None if to is home else (to, Reason.NEW)
        diverted = PrefixPolicy._diversion(request, view, home, scored, url_to_depth)
        return None if diverted is None else (diverted, Reason.LOAD)

    @staticmethod
    def _diversion(
        request: RouteRequest,
        view: FleetView,
        home: Scored,
        scored: list[Scored],
        url_to_depth: dict[str, int],
    ) -> Scored | None:
        """The candidate worth leaving ``home`` for (class docstring), or None."""
        cost = view.cost
        home_ttft_s, _, home_url, home_cached = home
        gain = cost.divert_pressure_gain
        bar_s = home_ttft_s - diversion_margin_s(home_ttft_s, cost)
        # lazily, as most requests stay home before a charge is needed: the part of the
        # home's hit its running requests use, and the recompute's weight
        shared, share = 0, None
        best: Scored | None = None
        best_key: tuple[float, int, int] | None = None
        for s in scored:  # cheapest first: once one is above the bar, all later ones are
            ttft_s, minus_score, url, cached = s
            if ttft_s >= bar_s:
                break
            if url_to_depth[url] >= url_to_depth[home_url]:
                continue  # another holder of the deepest match is never a diversion
            charged_s = ttft_s
            if cost.divert_recompute_share > 0:
                if share is None:
                    shared = _shared_head_tokens(request, view, home_url, home_cached)
                    pressure = _busy_share(view, scored)
                    share = cost.divert_recompute_share * (1.0 + gain * pressure)
                spread = shared > cached and not view.placement(url, request, cached).hot_blocks
                # a head copied into room spreads: only the rest of the hit is charged
                charged_from_s = view.estimate_ttft_s(url, request, shared) if spread else ttft_s
                recompute_s = charged_from_s - view.estimate_ttft_s(url, request, home_cached)
                charged_s += share * max(0.0, recompute_s)
            key = (round(charged_s, 9), -url_to_depth[url], minus_score)
            if charged_s < bar_s and (best_key is None or key < best_key):
                best, best_key = s, key
        return best

    def _homes(self, view: FleetView, tie_key: int) -> list[str]:
        """``num_hashed`` backends picked by slices of ``tie_key`` (O(1), same everywhere)."""
        eligible = view.candidates()
        if not eligible:
            return []
        return [eligible[(tie_key >> (16 * j)) % len(eligible)] for j in range(self.num_hashed)]


def _new_on_cost(
    request: RouteRequest, view: FleetView, home: Scored, scored: list[Scored]
) -> bool:
    """Whether ``request`` is mostly new (its home's hit under ``divert_min_cached_share``
    of the prompt) and so goes to the cheapest candidate, as a new prompt, not charged as
    a diversion: unless every candidate has prefill queued (with a pressure gain), when
    leaving the part of its context its home holds is charged (``_diversion``)."""
    cost = view.cost
    if not _mostly_new(request, home[3], cost):
        return False
    return not (cost.divert_pressure_gain > 0 and _busy_share(view, scored) == 1.0)


def _mostly_new(request: RouteRequest, home_cached: int, cost: CostConfig) -> bool:
    """The home's hit is under ``divert_min_cached_share`` of the prompt."""
    return home_cached < cost.divert_min_cached_share * request.num_prompt_tokens


def _busy_share(view: FleetView, scored: list[Scored]) -> float:
    """The share of the candidates with prefill queued: they include the least-loaded
    backends, so 1.0 means no idle capacity anywhere the request could go."""
    busy = sum(1 for s in scored if view.load(s[2]).queued_prefill_tokens > 0)
    return busy / len(scored)


def _shared_head_tokens(
    request: RouteRequest, view: FleetView, url: str, cached_tokens: int
) -> int:
    """The part of ``request``'s hit on ``url`` that requests running there also use
    (their chains share it: core/load.ActiveBlocks), in tokens: a shared head, not the
    request's own context."""
    keys = request.block_hashes
    num_new = view.active_blocks(url, keys) - view.active_blocks(url)
    pinned = cached_tokens_for(len(keys) - num_new, request.num_prompt_tokens, view.block_size)
    return min(cached_tokens, pinned)
