"""Reading Mooncake-format trace files (the I/O half of trace replay).

The trace data stays where it is (by default the shared folder beside the repository);
nothing of it is copied into the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.bench.workloads.mooncake import TraceRow

# src/kvroute/bench/tracefile.py -> the repository root is three folders up from bench/
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def read_mooncake_trace(path: str | Path, max_rows: int = 0) -> list[TraceRow]:
    """Rows of a Mooncake JSONL trace; ``max_rows`` > 0 stops early. ValueError names the line."""
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append(
                    TraceRow(
                        timestamp_ms=float(obj["timestamp"]),
                        input_length=int(obj["input_length"]),
                        output_length=int(obj["output_length"]),
                        hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({exc})") from None
            if max_rows and len(rows) >= max_rows:
                break
    return rows
