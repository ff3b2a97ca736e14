"""The engine loop: add requests, step, read outputs and stats (no I/O, no clock).

The caller (HTTP simulator or discrete-event simulator) loops: ``r = engine.step()``,
waits ``r.duration_s`` (real or virtual), then delivers ``r.outputs``. The engine never
reads the time: its state depends on the calls alone, so the same calls give the same
results under a real clock and a virtual one. ``a_api_ms`` is not inside ``step``: the
caller adds it to each request's TTFT.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat

import xxhash

from kvroute.common.hashing import chain_seed, token_block_hashes
from kvroute.common.kv_events import KvEvent
from kvroute.common.tokenizer import default_tokenizer
from kvroute.engine.block_manager import BlockManager
from kvroute.engine.profiles import EngineProfile
from kvroute.engine.request import HashedPrompt, PromptIds, Request
from kvroute.engine.scheduler import Scheduler
from kvroute.engine.step_time import StepTimeModel


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generated token of one request."""

    request_id: str
    token_id: int
    is_first: bool  # produced by the step that finished this request's prefill
    finish_reason: str | None  # "length" when max_tokens was reached, else None
    num_cached_tokens: int  # prefix-cache hit of this request at first scheduling, tokens


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did; its outputs are valid at ``now + duration_s``."""

    duration_s: float  # modelled engine time of the step (0.0 if idle)
    outputs: list[TokenOutput]  # tokens produced by the step
    num_prefill_tokens: int  # prompt (or recomputed) tokens computed in the step
    num_decode_seqs: int  # sequences that decoded one token in the step


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The gauges and counters vLLM exports on /metrics."""

    num_running: int  # vllm:num_requests_running
    num_waiting: int  # vllm:num_requests_waiting
    kv_cache_usage: float  # used (ref_cnt > 0) blocks / num_gpu_blocks, 0..1
    prefix_cache_queries: int  # tokens, cumulative (first lookups only, as vLLM)
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative
    block_size: int  # tokens per block (cache_config_info)
    num_gpu_blocks: int  # blocks in the cache (cache_config_info)
    preempted_prefix_cache_queries: int = 0  # tokens re-looked-up by preempted requests
    preempted_prefix_cache_hits: int = 0  # tokens of those found cached


class HashedTokens:
    """Output tokens drawn from the built-in tokenizer's one-token words, deterministically
    from (request id, index), so replays and tests see the same text. ``span`` gives a
    run of them at once (fast-forwarded decodes), every step in C."""

    def __init__(self) -> None:
        self._words = list(default_tokenizer().word_ids())

    def __call__(self, request_id: str, index: int) -> int:
        words = self._words
        return words[xxhash.xxh3_64_intdigest(request_id.encode(), index) % len(words)]

    def span(self, request_id: str, start: int, stop: int) -> Iterator[int]:
        """``self(request_id, i)`` for i in [start, stop)."""
        digests = map(xxhash.xxh3_64_intdigest, repeat(request_id.encode()), range(start, stop))
        return map(self._words.__getitem__, map(len(self._words).__rmod__, digests))


def default_next_token() -> Callable[[str, int], int]:
    """The built-in output tokens (``HashedTokens``)."""
    return HashedTokens()


def token_span(
    next_token: Callable[[str, int], int], request_id: str, start: int, stop: int
) -> Iterable[int]:
    """``next_token(request_id, i)`` for i in [start, stop), in C for the built-in tokens."""
    if isinstance(next_token, HashedTokens):
        return next_token.span(request_id, start, stop)
    return map(next_token, repeat(request_id), range(start, stop))


_IDLE = StepResult(0.0, [], 0, 0)


def size_error(profile: EngineProfile, num_prompt_tokens: int, max_tokens: int) -> str | None:
    """Why an engine of ``profile`` can never run a request of this size, or None."""
    limit = profile.max_model_len
    if num_prompt_tokens > limit:
        return f"the prompt ({num_prompt_tokens} tokens) is longer than max_model_len ({limit})"
    if num_prompt_tokens + max_tokens > limit:
        return (
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len ({limit})"
        )
    if -(-(num_prompt_tokens + max_tokens) // profile.block_size) > profile.num_gpu_blocks:
        return "the request needs more KV blocks than the whole cache holds"
    return None


class Engine:
    """A vLLM-V1-like engine: prefix-cached KV blocks, chunked-prefill batching, step times."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        rng: random.Random | None = None,
        jitter: float = 0.0,
        enable_kv_events: bool = False,
        next_token: Callable[[str, int], int] | None = None,
    ) -> None:
        self.profile = profile
        self.block_manager = BlockManager(
            profile.num_gpu_blocks, profile.block_size, enable_events=enable_kv_events
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
        )
        self.step_time = StepTimeModel(profile, jitter=jitter, rng=rng)
        # (request id, output index) -> token id; public for engine/fast_forward.py
        self.next_token = next_token if next_token is not None else default_next_token()
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._max_model_len = profile.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: PromptIds,
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        block_hashes: list[int] | None = None,
    ) -> None:
        """Queue a request; ValueError when it is malformed or can never fit.

        ``block_hashes``: the prompt's full-block hashes when the caller has them already
        (``token_block_hashes`` with this engine's block size and the salt's chain root);
        the engine keeps the list and extends it as output fills blocks.
        """
        self._validate(request_id, prompt_token_ids, max_tokens)
        seed = chain_seed(cache_salt)
        hashes = block_hashes
        if isinstance(prompt_token_ids, HashedPrompt):
            if hashes is None or self.block_manager.enable_events:
                raise ValueError(
                    "a HashedPrompt comes with its hashes, to an engine without events"
                )
        elif hashes is None:
            try:
                hashes = token_block_hashes(prompt_token_ids, self.profile.block_size, seed)
            except TypeError:
                raise ValueError("prompt_token_ids must be integers") from None
        req = Request(request_id, prompt_token_ids, max_tokens, hashes, seed, cache_salt)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def _validate(self, request_id: str, prompt: PromptIds, max_tokens: int) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if len(prompt) == 0:
            raise ValueError("the prompt must have at least one token")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        problem = size_error(self.profile, len(prompt), max_tokens)
        if problem is not None:
            raise ValueError(problem)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; an unknown or finished id is a no-op."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> StepResult:
        """Run one batch: schedule, cost it, and produce its tokens; its modelled time is
        ``duration_s`` of the result, the caller's clock (real or virtual) advances by it."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return _IDLE
        duration_s = self.step_time.duration_s(out.work)
        outputs: list[TokenOutput] = []
        sample = self._sample
        any_finished = False
        for req, num_new in out.scheduled:
            computed = req.num_computed_tokens + num_new
            req.num_computed_tokens = computed
            if computed >= len(req.token_ids):  # else a chunk that does not end the prompt
                token = sample(req)
                outputs.append(token)
                if token.finish_reason is not None:
                    any_finished = True
        if any_finished:
            self.scheduler.drop_finished()
        return StepResult(duration_s, outputs, out.work.num_prefill_tokens, out.num_decode_seqs)

    def _sample(self, req: Request) -> TokenOutput:
        """Append the next output token; finish the request at its length."""
        token_ids = req.token_ids
        index = len(token_ids) - req.num_prompt_tokens
        token_id = self.next_token(req.request_id, index)
        token_ids.append(token_id)
        finish_reason = None
        if index + 1 >= req.max_tokens or len(token_ids) >= self._max_model_len:
            finish_reason = "length"
            self.scheduler.finish(req)
            del self._requests[req.request_id]
        cached = req.num_cached_tokens
        return TokenOutput(req.request_id, token_id, index == 0, finish_reason, cached or 0)

    def drain_kv_events(self) -> list[KvEvent]:
        """KV events since the last drain (empty unless enable_kv_events)."""
        return self.block_manager.drain_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while requests hold blocks."""
        return self.block_manager.reset()

    @property
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            block_size=self.profile.block_size,
            num_gpu_blocks=self.profile.num_gpu_blocks,
            preempted_prefix_cache_queries=s.preempted_prefix_cache_queries,
            preempted_prefix_cache_hits=s.preempted_prefix_cache_hits,
        )

    def check_invariants(self) -> None:
        """Assert that the engine's request map matches the scheduler's queues."""
        listed = {r.request_id for r in self.scheduler.running}
        listed |= {r.request_id for r in self.scheduler.waiting}
        assert listed == set(self._requests), "engine request map != scheduler queues"
        self.scheduler.check_invariants()
