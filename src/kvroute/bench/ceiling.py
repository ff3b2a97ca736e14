"""The infinite-cache ceiling of one run: the best prefix-cache hit rate any router could get.

An engine with an infinite prefix cache, seeing every request the run sent in the
order it was sent, hits on each prompt the longest prefix an earlier prompt computed.
As in vLLM (and ``engine/block_manager.py``) a hit is whole blocks of the engine's
``block_size`` tokens, at most ``prompt - 1`` tokens (the last token is always
computed), and an earlier prompt leaves every one of its full blocks behind. The rate
is hit tokens / prompt tokens over the measured requests; warm-up requests fill the
cache but are not counted, as the engine counters of a run leave them out.

Prompts are keyed as the simulated engines key them: the built-in tokenizer over
``RequestSpec.prompt_text()`` (the rendered chat template for chat), chained block
hashes from ``kvroute.common.hashing``. Against a real engine the tokenizer differs, so
there the ceiling is an estimate. One pass, one set of hashes: cheap next to a run.

A router that ends a closed-loop run with slightly different requests in flight sends
a slightly different set, so the ceiling is computed per run (``SentSpecs`` keeps the
specs the load generator drew, the records say which were sent and when).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvroute.bench.metrics import RequestRecord
from kvroute.bench.spec import RequestSpec, Session
from kvroute.bench.workloads.base import Workload
from kvroute.common.hashing import token_block_hashes
from kvroute.common.tokenizer import Tokenizer, default_tokenizer
from kvroute.common.vllm_metrics import parse_vllm_metrics

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs, and every built-in engine profile's


class InfiniteCache:
    """Prompts in send order; counts what an engine with unbounded KV memory would hit."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hit_tokens = 0  # over counted prompts only
        self.prompt_tokens = 0
        self._seen: set[int] = set()

    def add(self, token_ids: Sequence[int], *, counted: bool = True) -> int:
        """Send one prompt; returns its hit tokens. Its full blocks are cached either way."""
        hashes = token_block_hashes(token_ids, self.block_size)
        usable = max(0, (len(token_ids) - 1) // self.block_size)
        matched = 0
        # Chained hashes: a block is seen only if its whole prefix was, so stop at a miss.
        while matched < usable and hashes[matched] in self._seen:
            matched += 1
        self._seen.update(hashes)
        hit = matched * self.block_size
        if counted:
            self.hit_tokens += hit
            self.prompt_tokens += len(token_ids)
        return hit

    @property
    def hit_rate(self) -> float | None:
        """Hit tokens / prompt tokens of the counted prompts; None before any."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None


def ceiling_hit_rate(
    prompts: Iterable[tuple[Sequence[int], bool]], block_size: int
) -> float | None:
    """Ceiling of ``(token_ids, counted)`` prompts in send order (counted False: warm-up)."""
    cache = InfiniteCache(block_size)
    for token_ids, counted in prompts:
        cache.add(token_ids, counted=counted)
    return cache.hit_rate


def spec_token_ids(spec: RequestSpec, tokenizer: Tokenizer | None = None) -> list[int]:
    """The prompt's token ids as a simulated engine sees them."""
    return (tokenizer or default_tokenizer()).encode(spec.prompt_text())


def run_ceiling(
    records: Iterable[RequestRecord],
    specs: dict[str, RequestSpec],
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> float | None:
    """The ceiling over the requests ``records`` says were sent, in send order.

    Warm-up requests all went before the measured run (their ``start_s`` counts from the
    warm-up's own start), so they come first. Every sent request fills the cache, failed
    ones too (one may have been prefilled before it failed); measured ones are counted.
    A record whose spec is unknown is left out.
    """
    sent = sorted(
        (r for r in records if r.request_id in specs), key=lambda r: (not r.warmup, r.start_s)
    )
    tokenizer = default_tokenizer()
    return ceiling_hit_rate(
        ((spec_token_ids(specs[r.request_id], tokenizer), not r.warmup) for r in sent),
        block_size,
    )


class SentSpecs(Workload):
    """``inner``'s sessions, each spec kept by request id as the load generator draws it.

    The load generator keeps only records; this keeps what they were records of. It
    holds references to specs already built, so it costs a dict entry per drawn request.
    """

    def __init__(self, inner: Workload) -> None:
        super().__init__(inner.params, inner.seed)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc] (instance label; the class has none)
        self.defaults = inner.defaults  # type: ignore[misc]
        self.specs: dict[str, RequestSpec] = {}

    def sessions(self) -> Iterator[Session]:
        for session in self.inner.sessions():
            for spec in session:
                self.specs[spec.request_id] = spec
            yield session

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def block_size_of(metrics_text: str) -> int | None:
    """``block_size`` of a vLLM /metrics page's ``vllm:cache_config_info``; None if absent."""
    try:
        return parse_vllm_metrics(metrics_text).block_size
    except ValueError:
        return None
