"""Reading trace files (the I/O half of trace replay): Mooncake's JSONL and Azure's CSV.

The trace data stays where it is (by default the shared folder beside the repository);
nothing of it is copied into the repository.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from kvroute.bench.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRow

# src/kvroute/bench/tracefile.py -> the repository root is three folders up from bench/
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_AZURE_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_inference_2023_conv.csv"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_mooncake_trace(path: str | Path, max_rows: int = 0) -> list[TraceRow]:
    """Rows of a Mooncake JSONL trace; ``max_rows`` > 0 stops early. ValueError names the line."""
    rows: list[TraceRow] = []
    with _open_trace(path) as f:
        for line_no, line in enumerate(_text_lines(f, path), 1):
            if not line.strip():
                continue
            try:
                rows.append(_mooncake_row(json.loads(line)))
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({exc})") from None
            if max_rows and len(rows) >= max_rows:
                break
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    return rows


def _mooncake_row(obj: Any) -> TraceRow:
    """One row of a Mooncake trace from its JSON; ValueError, KeyError, TypeError or
    OverflowError (an infinite length) when it is not one."""
    timestamp_ms = float(obj["timestamp"])
    if not math.isfinite(timestamp_ms):  # json reads Infinity and NaN; the run would hang
        raise ValueError(f"timestamp {obj['timestamp']} is not a finite number")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):  # a string would read as its digits
        raise TypeError(f"hash_ids must be a list, not {type(hash_ids).__name__}")
    return TraceRow(
        timestamp_ms=timestamp_ms,
        input_length=int(obj["input_length"]),
        output_length=int(obj["output_length"]),
        hash_ids=tuple(int(h) for h in hash_ids),
    )


def read_azure_trace(path: str | Path, max_rows: int = 0) -> list[TraceRow]:
    """Rows of an Azure LLM inference trace (CSV: ``TIMESTAMP``, ``ContextTokens``,
    ``GeneratedTokens``) as Mooncake rows, in file order: arrivals in ms from the earliest
    row (the replay sorts them), and block ids that no other row shares, since the trace
    has no prompt contents (every prompt is new: the traffic a cache-aware router must
    serve as well as a plain balancer does).
    ``max_rows`` > 0 stops early. ValueError names the line."""
    rows: list[TraceRow] = []
    next_id = 0
    start: datetime | None = None
    with _open_trace(path) as f:
        reader = csv.DictReader(_text_lines(f, path))
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not an Azure trace (no column {', '.join(missing)})")
        for line_no, rec in enumerate(reader, 2):
            try:
                at = datetime.fromisoformat(_seven_digit_fraction(rec["TIMESTAMP"]))
                if at.tzinfo is None:  # the 2023 traces' stamps are UTC without saying so
                    at = at.replace(tzinfo=UTC)
                start = start or at
                input_length = int(rec["ContextTokens"])
                num_blocks = max(1, -(-input_length // MOONCAKE_BLOCK_TOKENS))
                rows.append(
                    TraceRow(
                        timestamp_ms=(at - start).total_seconds() * 1000.0,
                        input_length=input_length,
                        output_length=int(rec["GeneratedTokens"]),
                        hash_ids=tuple(range(next_id, next_id + num_blocks)),
                    )
                )
                next_id += num_blocks
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not an Azure trace row ({exc})") from None
            if max_rows and len(rows) >= max_rows:
                break
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    if (first := min(r.timestamp_ms for r in rows)) < 0:  # not sorted: count from the earliest
        rows = [replace(r, timestamp_ms=r.timestamp_ms - first) for r in rows]
    return rows


def _open_trace(path: str | Path) -> BinaryIO:
    """The trace file for reading (bytes: ``_text_lines`` decodes them); ValueError (what
    the CLIs print) when it cannot be."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise ValueError(
            f"cannot read the trace {path} ({exc.strerror or exc}): pass its path with"
            " --trace PATH (or --workload mooncake:PATH / azure:PATH); the default is"
            " ../shared/traces/ beside the repository"
        ) from None


def _text_lines(f: BinaryIO, path: str | Path) -> Iterator[str]:
    """The lines of ``f`` as UTF-8 text, line endings kept (what ``csv`` reads), a byte
    order mark on the first dropped (Excel writes one); ValueError names a line that is
    not UTF-8."""
    for line_no, line in enumerate(f, 1):
        try:
            yield line.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not UTF-8 text ({exc})") from None


def _seven_digit_fraction(stamp: str) -> str:
    """Azure writes 100-ns fractions (``18:15:46.6805900``); Python 3.11 reads at most 6.
    The 2024 traces add a UTC offset (``00:00:00.009930+00:00``), kept."""
    head, dot, rest = stamp.strip().partition(".")
    if not dot:
        return head
    digits = len(rest) - len(rest.lstrip("0123456789"))
    return f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
