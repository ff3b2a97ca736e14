"""Where a replayed trace's returning conversations were served, router by router.

A row of a Mooncake-format trace "continues" an earlier row when it extends more than its
first block of that row's hash ids (the first block is the system prompt every request
shares). For one run of a replay (its ``records.jsonl``, request ``mooncake-<n>`` being
row n in the file's order, as ``MooncakeReplay`` names them with one copy), this counts
the share of prompt tokens each kind of request hit (continuations, new prompts, prompts
of at most two blocks), and how many continuations went to their parent's backend and
what share of the parent's tokens they then hit, against those that went elsewhere.
``scripts/trace_continuations.py`` prints it for several runs side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.bench.metrics import RequestRecord
from kvroute.bench.workloads.mooncake import TraceRow

KINDS = ("continuation", "new", "short")


def parents(rows: Sequence[TraceRow]) -> dict[int, tuple[int, int]]:
    """Row index -> (the latest earlier row its prompt extends, hash ids shared), for rows
    that share more than their first id with an earlier one."""
    latest: dict[tuple[int, ...], int] = {}  # every prefix of ids seen -> its latest row
    out = {}
    for i, row in enumerate(rows):
        ids = row.hash_ids
        for k in range(len(ids), 1, -1):
            parent = latest.get(ids[:k])
            if parent is not None:
                out[i] = (parent, k)
                break
        for k in range(1, len(ids) + 1):
            latest[ids[:k]] = i
    return out


@dataclass(frozen=True, slots=True)
class ContinuationStats:
    """One run's figures; hit shares are of prompt tokens."""

    requests: dict[str, int]  # kind -> measured, completed requests
    hit: dict[str, float]  # kind -> share of their prompt tokens the engines had cached
    stayed: int  # continuations served where their parent was
    moved: int  # ... and elsewhere
    stayed_hit: float  # share of the parent's tokens they hit, when they stayed
    moved_hit: float  # ... when they moved


def continuation_stats(
    rows: Sequence[TraceRow], records: Iterable[RequestRecord], block_tokens: int = 512
) -> ContinuationStats:
    """The figures of one run (module doc); ``block_tokens``: tokens of one hash id in the
    replay (512 x the replay's ``input_scale``)."""
    by_id = {r.request_id: r for r in records}
    links = parents(rows)

    def done(i: int) -> RequestRecord | None:
        r = by_id.get(f"mooncake-{i:07d}")
        return r if r is not None and r.ok and not r.warmup else None

    counts = dict.fromkeys(KINDS, 0)
    prompt = dict.fromkeys(KINDS, 0)
    cached = dict.fromkeys(KINDS, 0)
    for i, row in enumerate(rows):
        r = done(i)
        if r is None:
            continue
        kind = "continuation" if i in links else "short" if len(row.hash_ids) <= 2 else "new"
        counts[kind] += 1
        prompt[kind] += r.prompt_tokens
        cached[kind] += r.cached_tokens or 0
    # [stayed, moved] x (requests, tokens hit, the parent's tokens they could hit)
    n, hit, could = [0, 0], [0, 0], [0, 0]
    for i, (parent, shared) in links.items():
        r, p = done(i), done(parent)
        if r is None or p is None:
            continue
        side = 0 if r.backend == p.backend else 1
        n[side] += 1
        hit[side] += r.cached_tokens or 0
        could[side] += min(shared * block_tokens, r.prompt_tokens)
    return ContinuationStats(
        requests=counts,
        hit={k: cached[k] / prompt[k] if prompt[k] else 0.0 for k in KINDS},
        stayed=n[0],
        moved=n[1],
        stayed_hit=hit[0] / could[0] if could[0] else 0.0,
        moved_hit=hit[1] / could[1] if could[1] else 0.0,
    )


def format_stats(runs: Mapping[str, ContinuationStats]) -> str:
    """One line per run."""
    w = max(len("run"), *map(len, runs))
    lines = [
        f"{'run':<{w}} {'continuations':>20} {'new':>14} {'short':>14} "
        f"{'stayed (hit of parent)':>24} {'moved (hit of parent)':>23}"
    ]
    for name, s in runs.items():
        kinds = [f"{s.requests[k]:,} at {100 * s.hit[k]:.1f} %" for k in KINDS]
        lines.append(
            f"{name:<{w}} {kinds[0]:>20} {kinds[1]:>14} {kinds[2]:>14} "
            f"{f'{s.stayed:,} ({100 * s.stayed_hit:.1f} %)':>24} "
            f"{f'{s.moved:,} ({100 * s.moved_hit:.1f} %)':>23}"
        )
    return "\n".join(lines)
