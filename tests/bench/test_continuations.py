"""The continuation breakdown of a trace replay (bench/continuations.py)."""

from __future__ import annotations

from kvroute.bench.continuations import continuation_stats, format_stats, parents
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.workloads.mooncake import TraceRow


def _row(*ids: int) -> TraceRow:
    return TraceRow(0.0, 512 * len(ids), 8, ids)


def _record(n: int, backend: str, prompt: int, cached: int) -> RequestRecord:
    return RequestRecord(
        request_id=f"mooncake-{n:07d}", prefix_group="g", session_id=None, turn=0,
        start_s=float(n), ok=True, ttft_s=0.1, itl_s=(), e2e_s=0.2, prompt_tokens=prompt,
        output_tokens=8, cached_tokens=cached, backend=backend, decision="prefix",
    )  # fmt: skip


ROWS = [
    _row(0, 1, 2),  # a conversation
    _row(0, 5, 6),  # another
    _row(0, 1, 2, 3),  # the first one's next turn: shares 3 ids
    _row(0, 5, 6, 7, 8),  # the second's: shares 3 ids
    _row(0),  # a short prompt, sharing only the first id
]


def test_a_row_continues_the_latest_row_it_extends_beyond_the_first_id() -> None:
    assert parents(ROWS) == {2: (0, 3), 3: (1, 3)}
    assert parents([_row(0, 1), _row(0, 1), _row(0, 1, 2)]) == {1: (0, 2), 2: (1, 2)}


def test_turns_that_stay_and_turns_that_move_are_counted_apart() -> None:
    records = [
        _record(0, "a", 1536, 0),
        _record(1, "b", 1536, 512),
        _record(2, "a", 2048, 1536),  # stayed and hit the whole parent
        _record(3, "a", 2560, 512),  # moved: only the shared head
        _record(4, "b", 512, 0),
    ]
    s = continuation_stats(ROWS, records)
    assert s.requests == {"continuation": 2, "new": 2, "short": 1}
    assert (s.stayed, s.moved) == (1, 1)
    assert (s.stayed_hit, s.moved_hit) == (1.0, 512 / 1536)
    assert s.hit["continuation"] == (1536 + 512) / (2048 + 2560)
    assert s.hit["new"] == 512 / 3072
    assert "1 (100.0 %)" in format_stats({"run": s})
