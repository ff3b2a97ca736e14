"""The ``agentic`` workload as a Mooncake-format trace: fixed arrivals, lengths, hash ids.

Agent traffic often reaches a router as a recorded trace rather than a live harness: no
session header, arrival times fixed in advance, prompts known only by their 512-token
blocks. ``agentic_trace`` turns ``agentic`` sessions into such rows, so that a router can
be judged on that form too (``kvroute compare`` / ``kvroute simulate --workload mooncake
--trace FILE``; ``scripts/agentic_trace.py`` writes the file).

Load: ``users`` sessions at once; each user starts its next session when one ends. A
turn arrives its ``think_time_s`` (the workload's tool-loop gap or human pause) after the
previous turn would have finished, at a nominal service time of ``ttft_s`` plus
``itl_s`` per output token: an open-loop trace cannot know the real one, which is what
makes it a harder test than the closed loop (a slow router does not slow the arrivals).

Hash ids: a block wholly inside the session's harness prompt gets the harness's id for
that position (shared by every session on it); a full block past it gets the session's
id for that position (the context only grows, so it stays the same in later turns); the
partial last block of a prompt gets an id of its own. Ids are numbered in order of first
use, as in the Mooncake traces.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from kvroute.bench.spec import message_tokens
from kvroute.bench.workloads.agentic import Agentic
from kvroute.bench.workloads.mooncake import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class AgenticTraceRow:
    """One request; ``session`` and ``turn`` say where it came from (not in the file)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int
    turn: int

    def to_json_obj(self) -> dict[str, object]:
        """The Mooncake row: timestamp, input_length, output_length, hash_ids."""
        return {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


def agentic_trace(
    workload: Agentic,
    *,
    users: int,
    duration_s: float,
    ttft_s: float = 0.5,
    itl_s: float = 0.03,
    start_spread_s: float = 30.0,
) -> list[AgenticTraceRow]:
    """The rows that arrive within ``duration_s``, in arrival order (module doc)."""
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if min(ttft_s, itl_s, start_spread_s) < 0:
        raise ValueError("ttft_s, itl_s and start_spread_s must be >= 0")
    # harness text -> (its index, the blocks its rendered system message fills)
    harness_of = {
        text: (k, message_tokens("system", text) // MOONCAKE_BLOCK_TOKENS)
        for k, text in enumerate(workload.harness_prompts)
    }
    ids: dict[tuple[object, ...], int] = {}
    rng = random.Random(f"{workload.seed}:agentic-trace")
    free = [(rng.uniform(0, start_spread_s), u) for u in range(users)]  # (free at, user)
    heapq.heapify(free)
    rows: list[AgenticTraceRow] = []
    next_session = 0
    while free:
        t, user = heapq.heappop(free)
        if t > duration_s:
            continue  # this user is done
        index, next_session = next_session, next_session + 1
        turns = workload.session(index)
        system = turns[0].messages
        assert system is not None, "agentic turns are chat requests"
        harness, shared_blocks = harness_of[system[0][1]]
        for spec in turns:
            t += spec.think_time_s
            if t > duration_s:
                break
            n = spec.num_prompt_tokens
            hash_ids = []
            for j in range(-(-n // MOONCAKE_BLOCK_TOKENS)):
                if j < shared_blocks:
                    key: tuple[object, ...] = ("harness", harness, j)
                elif (j + 1) * MOONCAKE_BLOCK_TOKENS <= n:
                    key = ("session", index, j)
                else:
                    key = ("partial", index, spec.turn, j)
                hash_ids.append(ids.setdefault(key, len(ids)))
            rows.append(
                AgenticTraceRow(
                    round(t * 1000), n, spec.max_tokens, tuple(hash_ids), index, spec.turn
                )
            )
            t += ttft_s + itl_s * spec.max_tokens
        heapq.heappush(free, (t, user))
    rows.sort(key=lambda r: r.timestamp_ms)  # stable: ties keep the order they were made
    return rows
