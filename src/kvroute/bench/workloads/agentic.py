"""``agentic``: agent coding sessions, as Claude Code / Codex / SWE-agent harnesses send them.

A session picks one of a few shared harness system prompts (tools and instructions,
skewed popularity), then sends a user message holding its own repository context (unique
to the session) and its task. Each later turn appends the assistant's previous answer
and a tool output, so every prompt extends the previous one and the context grows turn
by turn until the session has sent its drawn number of turns or the next turn would
pass ``max_context_tokens``. Between turns the agent waits a short tool-loop gap, or now
and then a human pause. The answers are synthetic (seeded by session and turn), not the
server's text, so the sessions stay deterministic whatever the server says.

Everything of session ``i`` comes from ``random.Random(f"{seed}:agentic:{i}")``, so a
session is the same however many sessions come before it or how they are consumed.

Default load: a closed loop of 128 users, each running sessions back to back, on
4 x ``llama-3.1-8b-a100`` (440,000 KV tokens each, 1,760,000 in the fleet). Sizes from
1,000 generated sessions (seed 0):

- a session starts at 11.2k tokens: its harness (6.0k / 9.2k / 9.5k, picked 55 / 27 /
  18 %) + 3.8k of its own (repository U(2k, 5k) + task U(50, 400));
- each turn adds ~1.03k: the answer (``max_tokens``: lognormal, median 100, mean 136)
  + a tool output (lognormal, median 600, mean 880, 100 to 4,000) + template tags. So
  the cap (30k) comes after ~18 turns; turns are drawn U(4, 40), 74 % of sessions end
  at the cap, 15.3 turns on average. A request's prompt averages 19.2k tokens, 11.9k of
  them the session's own;
- gaps: 88 % tool loop U(1, 5) s, 12 % human pause U(20, 120) s: 10.8 s on average.

Working set: 128 live sessions x 11.9k own tokens + 24.7k of harness prompts = 1.55M
tokens = 0.88 x the fleet's KV, of which the running requests pin about half (a turn
spends ~14 s in the engine: ~70 of the 128 sessions are in flight). That is the cache
full: the engine model (a virtual-time closed loop of 4 engines, 1,200 engine-s) gives a
router that keeps each session on one backend 89-90 % hit against a 94 % infinite-cache
ceiling, 5.1-5.4 requests/s, P99 TTFT ~4.5 s; scattering the sessions (round robin)
collapses: 55 % hit, preemptions, 1.9 requests/s, P99 TTFT 140 s. Every point of hit rate
counts, because a miss is expensive: recomputing a 25k-token context takes ~3 s of
engine time (linear + attention terms), against ~0.6 s for a turn that hits.

Why not a working set of 1.5-2.5 x the KV with these gaps: the fleet serves ~5
requests/s at best, and 230 users (1.5 x) with ~11 s gaps would offer ~10: the closed
loop then piles requests into the engines until the running requests alone fill the KV,
and every router (ideal stickiness included) falls into preemption and recompute (model:
hit 40-55 %, throughput halved). A scarcer cache needs idler sessions: ``--concurrency
230 --workload-arg human_pause_prob=0.3 --workload-arg human_pause_s=40,240`` gives 1.6 x
(model, 2,400 engine-s: sticky 60 % hit with 760 preemptions, round robin 45 %, against
a 94 % ceiling), but its sessions last ~17 engine-minutes, so a run must be long (> 20
engine-minutes) to get past the growth from 11k-token contexts at the start.

Cost of a run: at most 128 streams open; ~5 requests/s of engine time is ~20/s of wall
time at ``--speedup 4``, each body ~90 KB (19k 4-letter words) and ~136 streamed
tokens: ~2 MB/s and ~3,000 SSE chunks/s through the client, the router and the fleet.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.bench.spec import RequestSpec, Session, chat_prompt_tokens, seeded_words, words_text
from kvroute.bench.workloads.base import Workload, WorkloadDefaults, check_positive

# Tokens the chat template adds around one message ("<|user|>\n" ... "\n") and the
# final assistant cue; a generous bound used only to check the parameters up front.
_TEMPLATE_SLACK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class AgenticParams:
    """Sizes in tokens (of the built-in tokenizer), times in seconds (engine time).

    Harnesses:
      ``num_harnesses``: shared harness system prompts (tools + instructions).
      ``harness_tokens``: (a, b): each harness prompt's size, drawn once per harness
      from U(a, b) (seeded by the workload seed and the harness index).
      ``harness_zipf_s``: popularity: a session picks harness k (0-based) with weight
      1 / (k + 1) ** s; 0 = uniform. Default 1.0: 55 / 27 / 18 % for three harnesses.

    Session start:
      ``repo_tokens``: (a, b): the session's own repository context (file tree, key
      files), U(a, b), at the start of its first user message.
      ``task_tokens``: (a, b): the task statement after it, U(a, b).

    Turns:
      ``min_turns``, ``max_turns``: the session's number of turns, U(min, max); fewer
      when the cap is reached first.
      ``answer_tokens``: (lo, hi): each turn's ``max_tokens`` (the answer, replayed
      into the next turn) is lognormal with median ``answer_median_tokens`` and shape
      ``answer_sigma``, clipped to [lo, hi].
      ``tool_output_tokens``: (lo, hi): the tool output appended after each answer,
      lognormal with median ``tool_output_median_tokens`` and shape
      ``tool_output_sigma``, clipped to [lo, hi] (heavy-ish: a few outputs of
      thousands of tokens, most of hundreds).
      ``max_context_tokens``: the cap: a session ends before the turn whose prompt +
      ``max_tokens`` would pass it (so every request fits a 32k-token model).

    Gaps between turns (``RequestSpec.think_time_s``; turn 0 has none):
      ``human_pause_prob``: chance that a gap is a human pause rather than the tool loop.
      ``tool_gap_s``: (a, b): tool-loop gap, U(a, b).
      ``human_pause_s``: (a, b): human pause, U(a, b).

    Headers:
      ``session_header``: when non-empty (e.g. ``x-session-id``), every request carries
      this header with its session id as the value; "" (default) sends no header.
    """

    num_harnesses: int = 3
    harness_tokens: tuple[int, ...] = (5000, 10000)
    harness_zipf_s: float = 1.0
    repo_tokens: tuple[int, ...] = (2000, 5000)
    task_tokens: tuple[int, ...] = (50, 400)
    min_turns: int = 4
    max_turns: int = 40
    answer_median_tokens: int = 100
    answer_sigma: float = 0.8
    answer_tokens: tuple[int, ...] = (16, 1024)
    tool_output_median_tokens: int = 600
    tool_output_sigma: float = 1.0
    tool_output_tokens: tuple[int, ...] = (100, 4000)
    max_context_tokens: int = 30000
    human_pause_prob: float = 0.12
    tool_gap_s: tuple[float, ...] = (1.0, 5.0)
    human_pause_s: tuple[float, ...] = (20.0, 120.0)
    session_header: str = ""

    def __post_init__(self) -> None:
        check_positive(
            self,
            "num_harnesses",
            "min_turns",
            "answer_median_tokens",
            "tool_output_median_tokens",
            "max_context_tokens",
        )
        if self.max_turns < self.min_turns:
            raise ValueError("AgenticParams.max_turns must be >= min_turns")
        for name in ("harness_zipf_s", "answer_sigma", "tool_output_sigma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"AgenticParams.{name} must be >= 0")
        if not 0 <= self.human_pause_prob <= 1:
            raise ValueError("AgenticParams.human_pause_prob must be in [0, 1]")
        for name in ("harness_tokens", "repo_tokens", "task_tokens", "answer_tokens"):
            _check_range(self, name, minimum=1)
        _check_range(self, "tool_output_tokens", minimum=1)
        _check_range(self, "tool_gap_s", minimum=0)
        _check_range(self, "human_pause_s", minimum=0)
        first_turn = (
            self.harness_tokens[1]
            + self.repo_tokens[1]
            + self.task_tokens[1]
            + self.answer_tokens[1]
            + _TEMPLATE_SLACK_TOKENS
        )
        if first_turn > self.max_context_tokens:
            raise ValueError(
                f"AgenticParams.max_context_tokens ({self.max_context_tokens}) must hold the "
                f"largest first turn (harness + repo + task + answer: {first_turn})"
            )
        if self.session_header != self.session_header.strip() or ":" in self.session_header:
            raise ValueError(f"AgenticParams.session_header {self.session_header!r} is no name")


def _check_range(params: AgenticParams, name: str, minimum: float) -> None:
    lo_hi = getattr(params, name)
    if len(lo_hi) != 2 or not minimum <= lo_hi[0] <= lo_hi[1]:
        raise ValueError(f"AgenticParams.{name} must be two values {minimum} <= a <= b")


def _clipped_lognormal(rng: random.Random, median: int, sigma: float, lo_hi: tuple) -> int:
    value = round(rng.lognormvariate(math.log(median), sigma))
    return min(max(value, lo_hi[0]), lo_hi[1])


class Agentic(Workload):
    """Agent sessions on shared harness prompts whose contexts grow to a cap."""

    name = "agentic"
    defaults = WorkloadDefaults(mode="closed", num_users=128, num_requests=2000)
    params: AgenticParams

    def __init__(self, params: AgenticParams | None = None, seed: int = 0) -> None:
        super().__init__(params or AgenticParams(), seed)
        p = self.params
        sizes = random.Random(f"{seed}:agentic:harness-sizes")
        self._harnesses = [
            seeded_words(f"{seed}:agentic:harness:{h}", sizes.randint(*p.harness_tokens))
            for h in range(p.num_harnesses)
        ]
        self._harness_cum_weights = list(
            itertools.accumulate(1.0 / (k + 1) ** p.harness_zipf_s for k in range(p.num_harnesses))
        )

    @property
    def harness_prompts(self) -> tuple[str, ...]:
        """The shared harness system prompts, by index."""
        return tuple(self._harnesses)

    def sessions(self) -> Iterator[Session]:
        for index in itertools.count():
            yield self.session(index)

    def session(self, index: int) -> Session:
        """Session ``index`` on its own (the same as the ``index``-th of ``sessions()``)."""
        p = self.params
        rng = random.Random(f"{self.seed}:agentic:{index}")
        harness = rng.choices(range(p.num_harnesses), cum_weights=self._harness_cum_weights)[0]
        num_turns = rng.randint(p.min_turns, p.max_turns)
        session_id = f"agentic-{index:06d}"
        headers = ((p.session_header, session_id),) if p.session_header else ()
        repo = words_text(rng, rng.randint(*p.repo_tokens))
        task = words_text(rng, rng.randint(*p.task_tokens))
        messages: tuple[tuple[str, str], ...] = (
            ("system", self._harnesses[harness]),
            ("user", f"{repo} {task}"),
        )
        turns: list[RequestSpec] = []
        answer = ""  # the previous turn's answer, replayed into the next turn
        for t in range(num_turns):
            max_tokens = _clipped_lognormal(
                rng, p.answer_median_tokens, p.answer_sigma, p.answer_tokens
            )
            if t > 0:
                output = _clipped_lognormal(
                    rng, p.tool_output_median_tokens, p.tool_output_sigma, p.tool_output_tokens
                )
                messages = (
                    *messages,
                    ("assistant", answer),
                    ("user", words_text(rng, output)),
                )
            if chat_prompt_tokens(messages) + max_tokens > p.max_context_tokens:
                break  # the cap: this turn would not fit
            think = self._gap_s(rng) if t > 0 else 0.0
            turns.append(
                RequestSpec.chat(
                    f"agentic-{index:06d}-{t:02d}",
                    messages,
                    max_tokens,
                    session_id,
                    session_id=session_id,
                    turn=t,
                    think_time_s=think,
                    headers=headers,
                )
            )
            answer = words_text(rng, max_tokens)
        return tuple(turns)

    def _gap_s(self, rng: random.Random) -> float:
        p = self.params
        if rng.random() < p.human_pause_prob:
            return rng.uniform(*p.human_pause_s)
        return rng.uniform(*p.tool_gap_s)
