"""In-flight load per backend: counted by the router at dispatch, merged with engine gauges.

The router counts a request the moment it decides (before the request reaches the
backend), so a burst of decisions sees the load of the decisions before it, which a
scraped gauge would show only a scrape interval later. Each request holds one ``Ticket``;
its counts are released exactly once: prefill tokens at the first token (or at the end,
whichever comes first), everything at finish, error, timeout or client disconnect.
Finishing a ticket twice is a no-op.

Counts that reach this module come from clients (``max_tokens``) and engines (gauges), so
they pass through ``clamp_count`` first: every sum and product below stays a finite float
and ``int()`` of it can never raise (an OverflowError after ``acquire`` once leaked a
ticket and took a backend out of routing for good).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.common.hashing import leading_in

PRIOR_UNCACHED_TOKENS = 512.0  # mean uncached prompt tokens before any request was seen
PRIOR_DECODE_TOKENS = 256.0  # mean decode tokens before any request was seen
MEAN_ALPHA = 0.1  # EWMA weight of one request in the per-backend means
# Largest count the load arithmetic holds, tokens or requests: 2**53 is exact as a float,
# far above any real request, and a fleet's sum of them stays finite.
MAX_COUNT = 1 << 53


def clamp_count(value: float) -> int:
    """``value`` as a count in [0, MAX_COUNT]: negatives and nan are 0, huge ints and inf
    are MAX_COUNT (compared, never converted, so an int of any size cannot overflow)."""
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value  # the common case: two comparisons
    if value != value:  # nan
        return 0
    return int(min(max(value, 0), MAX_COUNT))


@dataclass(slots=True)
class Ticket:
    """One dispatched request's claim on a backend's load; the proxy keeps it until the end."""

    ticket_id: int  # unique per Fleet
    url: str  # backend the request was dispatched to
    request_id: str  # RouteRequest.request_id
    epoch: int  # incarnation of the backend at dispatch (a removed+re-added URL is new)
    dispatched_at_s: float  # `now` at dispatch
    num_prompt_tokens: int  # prompt length, tokens
    uncached_tokens: int  # queued prefill tokens this request added (prompt - predicted hit)
    decode_tokens: int  # decode tokens it added (its max_tokens)
    predicted_cached_tokens: int  # prefix hit the router predicted on `url`, tokens
    queued_ahead_tokens: int  # prefill tokens queued ahead of it on `url` at dispatch
    first_token_at_s: float | None = None  # set by on_first_token
    reported_cached_tokens: int | None = None  # engine-reported hit (usage.cached_tokens)
    is_prefill_released: bool = False  # uncached_tokens no longer counted as queued
    is_finished: bool = False  # everything released; further finishes are no-ops
    ok: bool | None = None  # how it ended (None while in flight)
    block_hashes: Sequence[int] = ()  # the prompt's keys (its blocks in ActiveBlocks)


class ActiveBlocks:
    """The distinct blocks (by key) of one backend's in-flight requests: a shared prefix
    counts once, as in the engine's memory while they run. The cost model reads it as the
    KV our requests pin (core/cost.py), fresh where the engine's gauge is a scrape old;
    it is also the "active blocks" of NVIDIA Dynamo's router, which its model reads.

    A request's keys are a chain (each key hashes its parent's), so the open requests'
    keys form a trie, and a key is present only if its parent is. Each present key
    counts the requests whose chain ends there plus its present children; a request
    adds only the keys not yet present (found by binary search: the present ones are a
    prefix of its chain) and, ending, removes keys from its end back while their count
    falls to 0. So a request costs O(log n) plus the keys it adds or frees, not its whole
    prompt: a hit on a running prefix touches a few blocks.

    With ``stride`` k it keeps every k-th key of a chain (the first of each k; still a
    chain, still a trie) and counts k blocks for each: k times less work for a cold
    prompt, for a count off by less than k blocks per request. The cost model needs no
    finer (kvroute: 8, a request's share of a cache is thousands of tokens; a cold
    2,000-block prompt costs ~60 us here instead of ~480); the Dynamo model counts
    every block (1), as Dynamo does.
    """

    __slots__ = ("key_to_count", "stride")

    def __init__(self, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError("ActiveBlocks.stride must be >= 1")
        self.stride = stride
        self.key_to_count: dict[int, int] = {}  # key -> chains ending here + present children

    def __len__(self) -> int:
        """Keys kept (blocks / stride)."""
        return len(self.key_to_count)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks of the requests in flight (to within stride - 1 per request)."""
        return len(self.key_to_count) * self.stride

    def add(self, keys: Sequence[int]) -> None:
        if not keys:
            return
        if self.stride > 1:
            keys = keys[:: self.stride]
        counts = self.key_to_count
        present = leading_in(keys, counts)
        if present < len(keys):
            if present:
                counts[keys[present - 1]] += 1  # a new child
            counts.update(dict.fromkeys(keys[present:-1], 1))  # one child each
            counts[keys[-1]] = 0
        counts[keys[-1]] += 1  # the chain ends here

    def remove(self, keys: Sequence[int]) -> None:
        """Undo ``add(keys)`` (of a chain added before and not removed since)."""
        if not keys:
            return
        if self.stride > 1:
            keys = keys[:: self.stride]
        counts = self.key_to_count
        # the keys only this chain held: the run from its end back whose count is 1
        # (no other chain ends there, one child); they go, and the key before loses a child
        live = len(keys)
        while live and counts[keys[live - 1]] == 1:
            live -= 1
        for key in keys[live:]:
            del counts[key]
        if live:
            counts[keys[live - 1]] -= 1

    def num_own(self, keys: Sequence[int]) -> int:
        """How many blocks of ``keys`` (the chain of a request in flight) no other request
        in flight holds: what its end frees (to within stride - 1)."""
        if not keys:
            return 0
        kept = keys[:: self.stride] if self.stride > 1 else keys
        counts = self.key_to_count
        live = len(kept)
        while live and counts.get(kept[live - 1]) == 1:  # as ``remove`` would drop them
            live -= 1
        return max(0, len(keys) - live * self.stride)

    def num_new(self, keys: Sequence[int]) -> int:
        """How many blocks of ``keys`` (a chain) no in-flight request holds (to within
        stride - 1)."""
        if not self.key_to_count:
            return len(keys)  # nothing in flight (most of a big idle fleet)
        if self.stride == 1:
            return len(keys) - leading_in(keys, self.key_to_count)
        kept = keys[:: self.stride]
        return max(0, len(keys) - leading_in(kept, self.key_to_count) * self.stride)


class BackendLoad:
    """Load of one backend: our in-flight counts and the engine's last scraped gauges.

    Invariant: every count is >= 0 and equals the sum over this backend's unreleased
    tickets (``check_invariants`` checks signs; the Fleet checks the sums).

    Merging (``requests``, ``queued_prefill_tokens``, ``in_flight_tokens``): each source is
    a lower bound of the truth. Our count misses traffic from other routers and requests
    sent before we started; the engine's gauge misses what we dispatched since the last
    scrape. So the merged value is the max of the two, not the sum (that would count our
    own requests twice) and not either alone. Engine gauges count requests; they become
    tokens through this backend's running mean of uncached and decode tokens per request.
    """

    __slots__ = (
        "decode_tokens",
        "engine_num_running",
        "engine_num_waiting",
        "in_flight_requests",
        "mean_decode_tokens",
        "mean_uncached_tokens",
        "queued_prefill_requests",
        "queued_prefill_tokens_ours",
    )

    def __init__(self) -> None:
        self.in_flight_requests = 0  # our dispatched, unfinished requests
        self.queued_prefill_requests = 0  # of which have not produced a first token
        self.queued_prefill_tokens_ours = 0  # their uncached prompt tokens
        self.decode_tokens = 0  # max_tokens of our in-flight requests
        self.engine_num_running: int | None = None  # last scraped vllm:num_requests_running
        self.engine_num_waiting: int | None = None  # last scraped vllm:num_requests_waiting
        self.mean_uncached_tokens = PRIOR_UNCACHED_TOKENS  # EWMA per dispatched request
        self.mean_decode_tokens = PRIOR_DECODE_TOKENS  # EWMA per dispatched request

    def means_after(self, ticket: Ticket) -> tuple[float, float]:
        """(mean uncached, mean decode tokens) once ``ticket`` is counted; changes nothing,
        so a caller can compute everything before it commits (``acquire``)."""
        a = MEAN_ALPHA
        uncached = self.mean_uncached_tokens
        decode = self.mean_decode_tokens
        return (
            uncached + a * (clamp_count(ticket.uncached_tokens) - uncached),
            decode + a * (clamp_count(ticket.decode_tokens) - decode),
        )

    def acquire(self, ticket: Ticket, means: tuple[float, float] | None = None) -> None:
        """Count a just-dispatched request (``means``: its ``means_after``, if computed)."""
        means = self.means_after(ticket) if means is None else means
        self.in_flight_requests += 1
        self.queued_prefill_requests += 1
        self.queued_prefill_tokens_ours += ticket.uncached_tokens
        self.decode_tokens += ticket.decode_tokens
        self.mean_uncached_tokens, self.mean_decode_tokens = means

    def unacquire(self, ticket: Ticket, means: tuple[float, float]) -> None:
        """Undo ``acquire`` exactly (``means``: the values before it): a dispatch that
        failed after counting leaves no trace."""
        self.release(ticket)
        self.mean_uncached_tokens, self.mean_decode_tokens = means

    def release_prefill(self, ticket: Ticket) -> None:
        """The request's prefill is done (first token): its uncached tokens leave the queue."""
        if ticket.is_prefill_released:
            return
        ticket.is_prefill_released = True
        self.queued_prefill_requests -= 1
        self.queued_prefill_tokens_ours -= ticket.uncached_tokens

    def release(self, ticket: Ticket) -> None:
        """The request ended (any way): release all it holds. Caller ensures once per ticket."""
        self.release_prefill(ticket)
        self.in_flight_requests -= 1
        self.decode_tokens -= ticket.decode_tokens

    def observe_engine(self, num_running: int | None, num_waiting: int | None) -> None:
        """Record the engine's scraped gauges (None keeps the previous value)."""
        if num_running is not None:
            self.engine_num_running = clamp_count(num_running)
        if num_waiting is not None:
            self.engine_num_waiting = clamp_count(num_waiting)

    @property
    def requests(self) -> int:
        """In-flight requests: max(ours, engine running + waiting)."""
        engine = (self.engine_num_running or 0) + (self.engine_num_waiting or 0)
        return max(self.in_flight_requests, engine)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens queued on the backend: max(ours, engine waiting x mean uncached)."""
        engine = int((self.engine_num_waiting or 0) * self.mean_uncached_tokens)
        return max(self.queued_prefill_tokens_ours, engine)

    @property
    def in_flight_tokens(self) -> int:
        """Queued prefill tokens plus decode tokens still to come (merged as above)."""
        return self._in_flight_tokens(self.queued_prefill_tokens)

    def _in_flight_tokens(self, queued_prefill_tokens: int) -> int:
        engine_decode = int((self.engine_num_running or 0) * self.mean_decode_tokens)
        return queued_prefill_tokens + max(self.decode_tokens, engine_decode)

    def merged(self) -> tuple[int, int, int]:
        """(``requests``, ``in_flight_tokens``, ``queued_prefill_tokens``) in one go."""
        queued = self.queued_prefill_tokens
        return self.requests, self._in_flight_tokens(queued), queued

    def check_invariants(self) -> None:
        assert self.in_flight_requests >= 0, "load: in_flight_requests < 0"
        assert 0 <= self.queued_prefill_requests <= self.in_flight_requests, (
            "load: queued_prefill_requests outside [0, in_flight_requests]"
        )
        assert self.queued_prefill_tokens_ours >= 0, "load: queued prefill tokens < 0"
        assert self.decode_tokens >= 0, "load: decode tokens < 0"
        if self.in_flight_requests == 0:
            assert self.queued_prefill_tokens_ours == 0 == self.decode_tokens, (
                "load: tokens left with no request in flight"
            )
