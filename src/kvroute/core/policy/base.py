"""The policy contract: one request in, one ranked Decision out.

A policy is one small class with one method, ``choose(request, view, now)``. It reads the
fleet through a ``FleetView`` (eligible backends, load, prefix matches, TTFT estimates)
and never mutates the index or the load counters: ``Fleet.dispatch`` does that once the
caller commits to the decision. State a policy keeps of its own (a round-robin cursor)
changes only inside ``choose``: what a policy needs to know of the fleet's past (holders,
load, rates, sessions) the Fleet keeps and the view offers.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any, ClassVar, NamedTuple, Protocol

import xxhash

from kvroute.core.cost import CostConfig
from kvroute.core.params import build


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request when it routes it."""

    request_id: str  # unique per request (the proxy's id), used in tickets and logs
    model: str | None  # requested model; None = any backend may serve it
    block_hashes: Sequence[int]  # chained keys, one per full engine block (common/hashing.py)
    num_prompt_tokens: int  # prompt length in tokens (estimate in approximate mode)
    max_tokens: int  # decode budget of the request, tokens
    # client session identity (a session header or the body's "user"), None without one;
    # the Fleet keys it per model, so one id on two models is two sessions
    session: str | None = None
    # False: the prompt is longer than the model's context (by the router's count), so the
    # engine will refuse it and cache nothing: the Fleet routes and counts it, but records
    # none of its blocks (a refused 80k-token prompt would flush a cache model's share)
    cacheable: bool = True


# How far a first token estimate (text keys, before the engines' answers taught the
# router the text's bytes per token) may exceed the context and the prompt still be taken
# for one the engine may serve: the built-in 4 bytes a token is a quarter low on English
# text (BENCHMARKS.md, "The seed experiment at real speed, at 0692028").
ESTIMATE_SLACK = 0.25


def fits_context(num_prompt_tokens: int, max_model_len: int | None, slack: float = 0.0) -> bool:
    """Whether a prompt of ``num_prompt_tokens`` fits a context of ``max_model_len`` (None:
    unknown, assumed to fit): vLLM keeps room for one output token. ``slack``: the share
    by which an uncertain count may exceed it (``ESTIMATE_SLACK``)."""
    return max_model_len is None or num_prompt_tokens < max_model_len * (1 + slack)


class Reason(enum.StrEnum):
    """Why a decision chose its backend (the ``x-kvroute-decision`` header, the
    ``reason`` label of ``kvroute_requests_total``)."""

    PREFIX = "prefix"  # the cheapest holder of the deepest cached prefix
    SESSION = "session"  # the session's last backend, holding the deepest prefix too
    LOAD = "load"  # less loaded (diverted from a holder, or a load-only policy)
    COLD = "cold"  # no holder: the cheapest candidate
    NEW = "new"  # mostly new (a short cached head, e.g. a shared system prompt): by cost
    HASH = "hash"  # the prefix's place on the consistent-hash ring
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    RETRY = "retry"  # a retry walking the ranking (``Decision.moved_to``)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why; ``ranked`` lets a retry move on without deciding again."""

    backend: str  # URL of the chosen backend
    reason: Reason  # why (a plain string from a peer worker's message compares equal)
    predicted_cached_tokens: int  # prefix-cache hit the router expects on `backend`, tokens
    ranked: tuple[str, ...]  # best first; ranked[0] == backend; retries walk it
    ttft_estimate_s: float | None = None  # the cost model's TTFT estimate on `backend`
    # the hit predicted on the holder this request was moved away from (``load``, ``new``)
    # beyond the hit on ``backend``: what the move gave up, so a run can tell what its
    # diversions cost; 0 otherwise
    left_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.ranked or self.ranked[0] != self.backend:
            raise ValueError("Decision.ranked must start with Decision.backend")

    def moved_to(self, url: str, reason: Reason = Reason.RETRY) -> Decision:
        """The same decision re-aimed at ``url`` (a retry): ``url`` first, then the rest.

        The proxy's retries walk ``ranked`` with it. ``Fleet.dispatch`` recomputes the
        predicted hit for the new backend itself; the TTFT estimate was ``backend``'s, so
        the moved decision has none.
        """
        rest = tuple(u for u in self.ranked if u != url)
        return Decision(url, reason, 0, (url, *rest), None)


class Placement(NamedTuple):
    """A request on one backend, as the cost model sees it."""

    ttft_s: float  # the estimate (``FleetView.estimate_ttft_s``)
    own_ttft_s: float  # without the recompute its evictions cause later: its own latency
    evicted_blocks: int  # cached blocks its new blocks push out
    hot_blocks: int  # of which its working set of reused blocks (core/working_set.py)


class CacheSize(NamedTuple):
    """One backend's cache as the router's index models it (``FleetView.cache_size``)."""

    held_blocks: int  # blocks the index holds for it (key blocks)
    capacity_blocks: int  # what it can hold, in the request's key blocks
    exact: bool  # True: read from its KV events (exact mode, synced); False: the router's record


@dataclass(frozen=True, slots=True)
class LoadView:
    """One backend's load as a policy sees it (ours merged with the engine's gauges)."""

    in_flight_requests: int  # requests dispatched and not finished (or engine running+waiting)
    in_flight_tokens: int  # queued prefill tokens + decode tokens still to come
    queued_prefill_tokens: int  # uncached prompt tokens not yet prefilled (before first token)
    weight: float  # relative capacity of the backend (1.0 = nominal)
    # this router's own dispatched, unfinished requests, without the engine's gauges: the
    # load a router that never scrapes counts (the SGLang and vllm-router models)
    own_in_flight_requests: int = 0


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """One backend's engine as the router's last /metrics scrape saw it (None: not
    reported yet): the raw figures a peer router reads (the models of core/policy/)."""

    num_waiting: int | None  # vllm:num_requests_waiting
    kv_cache_usage: float | None  # vllm:kv_cache_usage_perc, 0..1
    num_gpu_blocks: int | None  # vllm:cache_config_info num_gpu_blocks


class FleetView(Protocol):
    """Read-only view of the fleet for one routing call (request model and exclude applied).

    Every method costs O(1), O(k) or O(prompt blocks); only ``candidates()`` is O(fleet),
    for the simple policies that need the whole eligible list.
    """

    @property
    def rng(self) -> Random: ...  # the fleet's seeded generator (random-based policies)

    def candidates(self) -> Sequence[str]:
        """Eligible backends (healthy, not draining, serving the model, not excluded), by URL."""
        ...

    @property
    def excluded(self) -> frozenset[str]: ...  # backends this call must not choose (retries)

    def is_eligible(self, url: str) -> bool:
        """Whether ``url`` may be chosen by this call (the same test as ``candidates``)."""
        ...

    def least_loaded(self, k: int) -> list[str]:
        """Up to ``k`` eligible backends with the fewest in-flight tokens per weight."""
        ...

    def load(self, url: str) -> LoadView: ...

    def engine_gauges(self, url: str) -> EngineGauges:
        """``url``'s engine gauges as last scraped, unmerged with the router's own counts."""
        ...

    def mean_in_flight_tokens(self) -> float:
        """Mean weighted in-flight tokens over the healthy, non-draining fleet."""
        ...

    def active_blocks(self, url: str, block_hashes: Sequence[int] = ()) -> int:
        """Distinct blocks of the requests in flight on ``url`` (by key: a prefix they
        share counts once), plus the blocks of ``block_hashes`` none of them holds."""
        ...

    def cache_size(self, url: str) -> CacheSize:
        """How much ``url``'s cache model holds, its capacity, and where it comes from."""
        ...

    def match(self, block_hashes: Sequence[int], max_holders: int) -> list[tuple[str, int]]:
        """Eligible holders as (url, leading blocks held), deepest first, <= ``max_holders``."""
        ...

    def matched_blocks(self, url: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``block_hashes`` ``url``'s cache model holds."""
        ...

    def session_backend(self, session: str | None) -> str | None:
        """The backend ``session``'s last request (this model) was dispatched to, within
        the session TTL, if this call may choose it (``is_eligible``); else None."""
        ...

    def estimate_ttft_s(self, url: str, request: RouteRequest, cached_tokens: int) -> float:
        """Cost model: estimated TTFT of ``request`` on ``url`` given ``cached_tokens`` hit."""
        ...

    def placement(self, url: str, request: RouteRequest, cached_tokens: int) -> Placement:
        """The estimate with its parts: what placing a new prefix weighs (prefix.py)."""
        ...

    def cache_turnover(self, url: str) -> float:
        """How fast ``url``'s cache turns over lately (core/turnover.py), >= 0."""
        ...

    @property
    def reuse_concave(self) -> bool:
        """The fleet's reuse crowds just inside its caches' residency: spreading new
        prompts evenly keeps the most (core/reuse_regime.py)."""
        ...

    @property
    def block_size(self) -> int: ...  # tokens per engine block of the request's model

    @property
    def cost(self) -> CostConfig: ...  # the cost model's knobs (the diversion margin)


@dataclass(frozen=True, slots=True)
class NoParams:
    """The parameters of a policy that has none."""


class Policy(abc.ABC):
    """A routing policy. Subclasses set ``name`` and implement ``choose``.

    A policy with knobs declares them as a frozen dataclass ``Params`` (types, defaults
    and ranges, core/params.py) and takes an instance in its constructor; its factory,
    ``parse_params``, reads them from a plain mapping (the YAML section
    ``policies.<name>``, ``--policy-arg KEY=VALUE``), as llm-d's plugins parse their own.
    """

    name: ClassVar[str] = "abstract"
    Params: ClassVar[type[Any]] = NoParams
    # how often the router a model stands for reads the engines' /metrics, when that is
    # not kvroute's ``health.scrape_interval_s`` (the simulator scrapes at this interval)
    metrics_interval_s: ClassVar[float | None] = None
    # how finely the Fleet counts the blocks of requests in flight (core/load.ActiveBlocks):
    # every 8th block is plenty for the cost model; a model that reads them as counts, 1
    active_blocks_stride: ClassVar[int] = 8

    @classmethod
    def parse_params(cls, raw: Mapping[str, object] | None, path: str) -> Any:
        """This policy's ``Params`` from ``raw``; ConfigError names the key under ``path``."""
        return build(cls.Params, raw, path)

    @abc.abstractmethod
    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        """The decision for ``request``, or None when the view has no candidate."""


class SeededPolicy(Policy):
    """A policy that draws random numbers: from its own generator if given (tests,
    reproducible runs), else from the fleet's (``view.rng``)."""

    def __init__(self, params: NoParams | None = None, *, rng: Random | None = None) -> None:
        self._rng = rng

    def rng_for(self, view: FleetView) -> Random:
        return self._rng if self._rng is not None else view.rng


def cached_tokens_for(num_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine serves from ``num_blocks`` matched blocks: whole blocks within
    prompt - 1 (vLLM V1 recomputes the last token, so a prompt that is exactly its cached
    blocks recomputes its whole last block)."""
    return max(0, min(num_blocks, (num_prompt_tokens - 1) // block_size) * block_size)


def rendezvous_score(key: int, url: str) -> int:
    """Highest-random-weight score of ``url`` for ``key``; the same in every process.

    xxh3 of the URL seeded by the key, never Python's ``hash`` (salted per process).
    """
    return xxhash.xxh3_64_intdigest(url.encode(), key & 0xFFFF_FFFF_FFFF_FFFF)


def rendezvous_order(key: int, urls: Sequence[str]) -> list[str]:
    """``urls`` ordered by rendezvous score for ``key``, best first (deterministic)."""
    return sorted(urls, key=lambda u: (-rendezvous_score(key, u), u))


def request_key(request: RouteRequest) -> int:
    """A stable per-request key for tie-breaks: the first block key, else a hash of the id."""
    if request.block_hashes:
        return int(request.block_hashes[0])
    return xxhash.xxh3_64_intdigest(request.request_id.encode())


def rest_by_load(view: FleetView, first: Sequence[str], limit: int = 8) -> tuple[str, ...]:
    """``first`` followed by the least-loaded other candidates, for retries (at most ``limit``)."""
    seen = dict.fromkeys(first)
    for url in view.least_loaded(limit + len(seen)):
        if len(seen) >= max(limit, len(first)):
            break
        seen.setdefault(url)
    return tuple(seen)
