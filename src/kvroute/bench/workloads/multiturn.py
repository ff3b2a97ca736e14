"""``multiturn`` (chat/agent sessions) and ``zipf-hot`` (skewed prefix popularity).

``multiturn``: a few apps, each with a shared system prompt; a session belongs to one app
and has 3-10 turns; turn t sends the system prompt, every earlier user message and
answer, and a new user message, so each turn's prompt extends the previous one. The
previous answer is synthetic (``answer_tokens`` words seeded by session and turn), not
the server's text, so the sessions stay deterministic whatever the server says.

``zipf-hot``: many shared system prompts whose popularity follows Zipf(``zipf_s``)
(rank k drawn with weight 1 / k**s), each followed by a unique user message, so the
hottest prefixes carry more traffic than one replica should serve.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.bench.spec import RequestSpec, Session, seeded_words
from kvroute.bench.workloads.base import Workload, WorkloadDefaults, check_positive


@dataclass(frozen=True, slots=True)
class MultiturnParams:
    """Sizes in tokens, times in seconds."""

    num_apps: int = 4  # distinct shared system prompts
    system_prompt_tokens: int = 1024
    min_turns: int = 3
    max_turns: int = 10
    user_tokens: tuple[int, ...] = (64, 256)  # each user message: uniform in [a, b]
    answer_tokens: int = 128  # max_tokens of each turn and length of the replayed answer
    think_time_s: tuple[float, ...] = (1.0, 5.0)  # between turns: uniform in [a, b]

    def __post_init__(self) -> None:
        check_positive(self, "num_apps", "system_prompt_tokens", "min_turns", "answer_tokens")
        if self.max_turns < self.min_turns:
            raise ValueError("MultiturnParams.max_turns must be >= min_turns")
        for name in ("user_tokens", "think_time_s"):
            lo_hi = getattr(self, name)
            if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
                raise ValueError(f"MultiturnParams.{name} must be two values 0 <= a <= b")
        if self.user_tokens[0] < 1:
            raise ValueError("MultiturnParams.user_tokens must be >= 1")


class Multiturn(Workload):
    """Chat sessions whose prompts grow turn by turn."""

    name = "multiturn"
    defaults = WorkloadDefaults(mode="closed", num_users=16, think_time_s=(0.0, 1.0))
    params: MultiturnParams

    def __init__(self, params: MultiturnParams | None = None, seed: int = 0) -> None:
        super().__init__(params or MultiturnParams(), seed)
        p = self.params
        self._systems = [
            seeded_words(f"{seed}:multiturn:sys:{a}", p.system_prompt_tokens)
            for a in range(p.num_apps)
        ]

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self.seed)
        index = 0
        while True:
            yield self._session(index, rng)
            index += 1

    def _session(self, index: int, rng: random.Random) -> Session:
        p = self.params
        app = rng.randrange(p.num_apps)
        num_turns = rng.randint(p.min_turns, p.max_turns)
        history: tuple[tuple[str, str], ...] = (("system", self._systems[app]),)
        turns = []
        for t in range(num_turns):
            user = seeded_words(
                f"{self.seed}:multiturn:user:{index}:{t}", rng.randint(*p.user_tokens)
            )
            messages = (*history, ("user", user))
            think = rng.uniform(*p.think_time_s) if t > 0 else 0.0
            turns.append(
                RequestSpec.chat(
                    f"multiturn-{index:06d}-{t:02d}",
                    messages,
                    p.answer_tokens,
                    f"session-{index}",
                    session_id=f"session-{index}",
                    turn=t,
                    think_time_s=think,
                )
            )
            answer = seeded_words(f"{self.seed}:multiturn:answer:{index}:{t}", p.answer_tokens)
            history = (*messages, ("assistant", answer))
        return tuple(turns)


@dataclass(frozen=True, slots=True)
class ZipfHotParams:
    """Sizes in tokens."""

    num_prefixes: int = 256
    zipf_s: float = 1.1  # popularity exponent: weight of rank k is 1 / k**zipf_s
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 64

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in self.__dataclass_fields__.values()))


class ZipfHot(Workload):
    """Hot-spot test: a few prefixes are hot enough to need more than one replica."""

    name = "zipf-hot"
    defaults = WorkloadDefaults(mode="open", rates=(10.0,))
    params: ZipfHotParams

    def __init__(self, params: ZipfHotParams | None = None, seed: int = 0) -> None:
        super().__init__(params or ZipfHotParams(), seed)
        self._prefixes: dict[int, str] = {}

    def _prefix(self, rank: int) -> str:
        if rank not in self._prefixes:
            text = seeded_words(f"{self.seed}:zipf:prefix:{rank}", self.params.prefix_tokens)
            self._prefixes[rank] = text
        return self._prefixes[rank]

    def sessions(self) -> Iterator[Session]:
        p, rng = self.params, random.Random(self.seed)
        ranks = range(p.num_prefixes)
        cum_weights = list(itertools.accumulate(1.0 / (k + 1) ** p.zipf_s for k in ranks))
        index = 0
        while True:
            rank = rng.choices(ranks, cum_weights=cum_weights)[0]
            suffix = seeded_words(f"{self.seed}:zipf:suffix:{index}", p.suffix_tokens)
            messages = (("system", self._prefix(rank)), ("user", suffix))
            spec = RequestSpec.chat(f"zipf-{index:07d}", messages, p.output_tokens, f"zipf-{rank}")
            yield (spec,)
            index += 1
