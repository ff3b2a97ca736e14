"""``mooncake:PATH``: replay of a Mooncake-format trace (pure; reading the file is elsewhere).

Each row has ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
the prefix-chained ids of its 512-token blocks. Replay rules (docs/workloads.md):

- each hash id becomes one deterministic block of words, seeded by the workload seed and
  the id; a prompt is its blocks joined and cut to exactly ``input_length`` tokens, so
  equal leading ids give equal prompt prefixes and the trace's sharing is reproduced;
- quantised timestamps (the conversation trace uses ~3 s buckets, up to 28 requests
  each) are spread uniformly (seeded) over their bucket, keeping file order;
- rows are replayed in timestamp order (a stable sort: the file need not be sorted);
- ``speedup`` divides arrival times, ``max_requests`` keeps the file's first rows,
  ``input_scale`` shrinks prompts and blocks together (sharing kept), ``output_cap``
  bounds ``max_tokens``.

The ceiling reported beside a replay is the hit rate of an infinite cache by tokens:
each request hits its longest run of leading ids already seen, in whole blocks, capped
at its length (37.4 % for the conversation trace).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.bench.spec import RequestSpec, Session
from kvroute.bench.workloads.base import Workload, WorkloadDefaults
from kvroute.bench.workloads.word_blocks import WordBlockCache, prompt_token_ids
from kvroute.common.tokenizer import Tokenizer

MOONCAKE_BLOCK_TOKENS = 512
_TOKENIZER = Tokenizer()  # the marked words' ids (a private cache of pieces)


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a Mooncake-format trace."""

    timestamp_ms: float  # arrival, from the start of the trace
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # prefix-chained ids of the prompt's blocks

    def __post_init__(self) -> None:
        if self.input_length < 1 or self.output_length < 0 or not self.hash_ids:
            raise ValueError(f"bad trace row: {self}")


# prompts at most this many times the trace's (a 512-token block becomes 51,200 tokens)
MAX_INPUT_SCALE = 100.0


@dataclass(frozen=True, slots=True)
class MooncakeParams:
    """Replay options; a spread of None means: detect whether timestamps are quantised."""

    speedup: float = 1.0  # divides inter-arrival times
    max_requests: int = 0  # 0: every row
    input_scale: float = 1.0  # multiplies prompt lengths and the block size
    output_cap: int = 0  # 0: no cap on max_tokens
    spread_ms: float | None = None  # bucket width to spread over; 0: keep timestamps as is
    # N independent copies of the trace, interleaved by arrival (block ids and request ids
    # disjoint), for fleets far larger than the one the trace came from
    tile: int = 1

    def __post_init__(self) -> None:
        if not self.speedup > 0 or not self.input_scale > 0:
            raise ValueError("MooncakeParams.speedup and input_scale must be > 0")
        if not math.isfinite(self.speedup) or not self.input_scale <= MAX_INPUT_SCALE:
            raise ValueError(
                f"MooncakeParams.speedup must be finite and input_scale at most {MAX_INPUT_SCALE:g}"
            )
        if self.max_requests < 0 or self.output_cap < 0:
            raise ValueError("MooncakeParams.max_requests and output_cap must be >= 0")
        if self.spread_ms is not None and self.spread_ms < 0:
            raise ValueError("MooncakeParams.spread_ms must be >= 0")
        if self.tile < 1:
            raise ValueError("MooncakeParams.tile must be >= 1")


def detect_bucket_ms(timestamps_ms: Sequence[float]) -> float:
    """The bucket width of quantised timestamps, or 0.0 when they look continuous.

    Quantised means at least half of the rows share their timestamp with another row; the
    width is then the median gap between distinct values.
    """
    distinct = sorted(set(timestamps_ms))
    if len(distinct) < 2 or len(distinct) * 2 > len(timestamps_ms):
        return 0.0
    return float(statistics.median(b - a for a, b in itertools.pairwise(distinct)))


def spread_timestamps(
    timestamps_ms: Sequence[float], bucket_ms: float, rng: random.Random
) -> list[float]:
    """Each row's timestamp moved uniformly into [t, t + bucket_ms); file order is kept.

    Rows sharing a timestamp get sorted uniform offsets in file order, so arrival order
    within a bucket is the trace's order.
    """
    if bucket_ms <= 0:
        return [float(t) for t in timestamps_ms]
    by_value: dict[float, list[int]] = {}
    for i, t in enumerate(timestamps_ms):
        by_value.setdefault(t, []).append(i)
    out = [0.0] * len(timestamps_ms)
    for t, rows in by_value.items():
        offsets = sorted(rng.uniform(0.0, bucket_ms) for _ in rows)
        for i, offset in zip(rows, offsets, strict=True):
            out[i] = float(t) + offset
    return out


def infinite_cache_hit_rate(rows: Sequence[TraceRow], block_tokens: int = 512) -> float:
    """Token hit rate of an infinite, block-granular prefix cache over ``rows`` in order."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        matched = 0
        for h in row.hash_ids:
            if h not in seen:
                break
            matched += 1
        hit += min(matched * block_tokens, row.input_length)
        total += row.input_length
        seen.update(row.hash_ids)
    return hit / total if total else 0.0


def tile_marked(prompt: str, copy: int) -> str:
    """``prompt`` of copy ``copy`` (>= 1) of a tiled trace: its first two words replaced by
    capital letters spelling the copy number in base 26, as long as the words they
    replace. Each word is still one token (the built-in tokenizer's pieces are runs of up
    to four letters), so lengths, sharing within the copy and even the text's chunk
    boundaries are kept, while no block is shared with another copy (a prompt's first
    block differs, and every later block's key chains it). Generated prompts are
    lowercase, so no copy collides with the original."""
    words = prompt.split(" ", 2)
    width = sum(len(w) for w in words[:2])
    if copy >= 26**width:
        raise ValueError(f"too many copies of the trace for {width}-letter markers")
    letters = "".join(chr(ord("A") + (copy // 26**j) % 26) for j in range(width))
    words[0], rest = letters[: len(words[0])], letters[len(words[0]) :]
    if len(words) > 1:
        words[1] = rest
    return " ".join(words)


def tile_marked_ids(marked: str, ids: list[int] | None) -> list[int] | None:
    """The token ids of ``marked`` (``tile_marked`` of a prompt whose ids are ``ids``):
    only the two marked words' ids change, as no token spans the space after them."""
    if ids is None:
        return None
    head = marked.split(" ", 2)[:2]
    return _TOKENIZER.encode(" ".join(head)) + ids[len(head) :]


def scale_row(row: TraceRow, input_scale: float) -> TraceRow:
    """The row with its prompt scaled; block ids are kept, so sharing is kept."""
    if input_scale == 1.0:
        return row
    return TraceRow(
        row.timestamp_ms,
        max(1, round(row.input_length * input_scale)),
        row.output_length,
        row.hash_ids,
    )


class MooncakeReplay(Workload):
    """A Mooncake trace as specs with ``arrival_s`` set: replayed open loop, on schedule."""

    name = "mooncake"
    defaults = WorkloadDefaults(mode="trace", num_requests=None)
    params: MooncakeParams

    def __init__(
        self,
        rows: Sequence[TraceRow],
        params: MooncakeParams | None = None,
        seed: int = 0,
        *,
        source: str = "",
        name: str = "mooncake",
    ) -> None:
        super().__init__(params or MooncakeParams(), seed)
        self.name = name  # the trace's format: "azure" rows come through the same replay
        p = self.params
        kept = rows[: p.max_requests] if p.max_requests else rows
        # arrival order (stable: rows sharing a timestamp keep the file's order), which the
        # ceiling's infinite cache sees them in
        kept = sorted(kept, key=lambda r: r.timestamp_ms)
        self.rows = [scale_row(r, p.input_scale) for r in kept]
        self.block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * p.input_scale))
        self.source = source
        stamps = [r.timestamp_ms for r in self.rows]
        self.bucket_ms = detect_bucket_ms(stamps) if p.spread_ms is None else p.spread_ms
        # blocks kept: about 16M words in all (the conversation trace has 94M in 183k
        # blocks; tiled traces interleave many working sets)
        self._blocks = WordBlockCache(
            f"{self.seed}:mooncake:block:",
            self.block_tokens,
            max_blocks=max(4096, (1 << 24) // self.block_tokens),
        )

    def prompt_for(self, row: TraceRow) -> str:
        """The row's blocks joined and cut to exactly ``input_length`` tokens."""
        return self.prompt_and_ids(row)[0]

    def prompt_and_ids(self, row: TraceRow) -> tuple[str, list[int] | None]:
        """``prompt_for(row)`` and its token ids (``Tokenizer.encode`` of it; None for a
        scaled row whose blocks fall short)."""
        size, n = self.block_tokens, row.input_length
        needed = -(-n // size)
        blocks = self._blocks.get(row.hash_ids[:needed])
        texts = [b.text for b in blocks]
        if needed > len(row.hash_ids):
            # scaled rows may round one word past the blocks: repeat the first words
            words = " ".join(texts).split(" ")
            while len(words) < n:  # (a row longer than its blocks: repeat them to length)
                words.extend(words[: n - len(words)])
            return " ".join(words[:n]), None
        texts[-1] = blocks[-1].head(n - (needed - 1) * size)  # the last block, cut
        return " ".join(texts), prompt_token_ids(blocks, n)

    def sessions(self) -> Iterator[Session]:
        """The rows in arrival order; with ``tile`` N, N copies merged by arrival, copy k
        with its own spread of the buckets and its prompts marked (``tile_marked``)."""
        p = self.params
        start = min((r.timestamp_ms for r in self.rows), default=0.0)
        raw = [r.timestamp_ms for r in self.rows]
        id_span = 1 + max((max(r.hash_ids) for r in self.rows), default=0)
        copies = []
        for k in range(p.tile):
            rng = random.Random(self.seed if k == 0 else f"{self.seed}:tile:{k}")
            copies.append(spread_timestamps(raw, self.bucket_ms, rng))
        order = [(stamp, k, i) for k, stamps in enumerate(copies) for i, stamp in enumerate(stamps)]
        # by arrival, ties in copy and file order: a row sent after a later one would go out
        # as soon as that one is due (traces need not be sorted; spread buckets may overlap)
        order.sort(key=lambda x: x[0])
        for n, (stamp, k, i) in enumerate(order):
            row = self.rows[i]
            max_tokens = max(1, row.output_length)
            if p.output_cap:
                max_tokens = min(max_tokens, p.output_cap)
            group = row.hash_ids[1] if len(row.hash_ids) > 1 else row.hash_ids[0]
            prompt, ids = self.prompt_and_ids(row)
            if k:  # another copy: its own prefix groups, its own first words
                group += k * id_span
                prompt = tile_marked(prompt, k)
                ids = tile_marked_ids(prompt, ids)
            yield (
                RequestSpec(
                    request_id=f"{self.name}-{n:07d}",
                    endpoint="completions",
                    messages=None,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    num_prompt_tokens=row.input_length,
                    prefix_group=f"{self.name}-{group}",
                    arrival_s=(stamp - start) / 1000.0 / p.speedup,
                    prompt_token_ids=ids,
                ),
            )

    def ceiling_hit_rate(self) -> float:
        """Infinite-cache token hit rate of the replayed rows."""
        return infinite_cache_hit_rate(self.rows, self.block_tokens)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(
            source=self.source,
            num_rows=len(self.rows),
            bucket_ms=self.bucket_ms,
            cache_ceiling_hit_rate=self.ceiling_hit_rate(),
            span_s=self._span_s(),
        )
        return out

    def _span_s(self) -> float:
        if not self.rows:
            return 0.0
        stamps = [r.timestamp_ms for r in self.rows]
        return (max(stamps) - min(stamps) + self.bucket_ms) / 1000.0 / self.params.speedup
