"""The standard shared-prefix generators, with their published defaults.

- ``gsp``: SGLang ``generated-shared-prefix`` (64 groups x 16 prompts, 2,048-token system
  prompt per group, 128-token question, 256 output tokens). One round is the 1,024
  requests SGLang sends, shuffled; later rounds reuse the system prompts with new questions.
- ``prefix-repetition``: vLLM ``prefix_repetition`` (10 prefixes of 256 tokens, a unique
  256-token suffix, 128 output tokens), each round of 10 a shuffled pass over the prefixes.
- ``b2b``: llm-d's "KV-cache wins you can see" (150 groups x 6,000-token context, 5 users
  per group each with a fixed 1,200-token question, 1,000 output tokens); each request is
  a uniformly drawn (group, user) prompt; run as a Poisson rate ladder.

All three send ``/v1/completions`` with prompt = shared part + " " + own part, so the
prompt has exactly prefix + suffix tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.bench.spec import RequestSpec, Session, seeded_words
from kvroute.bench.workloads.base import Workload, WorkloadDefaults, check_positive


def completion_spec(
    request_id: str, prefix: str, suffix: str, num_tokens: int, max_tokens: int, group: str
) -> RequestSpec:
    """A completions request whose prompt is ``prefix + " " + suffix`` (``num_tokens`` long)."""
    return RequestSpec(
        request_id=request_id,
        endpoint="completions",
        messages=None,
        prompt=f"{prefix} {suffix}",
        max_tokens=max_tokens,
        num_prompt_tokens=num_tokens,
        prefix_group=group,
    )


@dataclass(frozen=True, slots=True)
class GspParams:
    """SGLang ``bench_serving --dataset-name generated-shared-prefix`` defaults."""

    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in self.__dataclass_fields__.values()))


class Gsp(Workload):
    """Many groups, each a long shared system prompt with short unique questions."""

    name = "gsp"
    defaults = WorkloadDefaults(mode="open", max_concurrency=16, num_requests=1024)
    params: GspParams

    def __init__(self, params: GspParams | None = None, seed: int = 0) -> None:
        super().__init__(params or GspParams(), seed)
        p = self.params
        self._systems = [
            seeded_words(f"{seed}:gsp:sys:{g}", p.system_prompt_tokens) for g in range(p.num_groups)
        ]

    def sessions(self) -> Iterator[Session]:
        p, rng = self.params, random.Random(self.seed)
        num_tokens = p.system_prompt_tokens + p.question_tokens
        index, round_ = 0, 0
        while True:
            pairs = [(g, q) for g in range(p.num_groups) for q in range(p.prompts_per_group)]
            rng.shuffle(pairs)
            for g, q in pairs:
                question = seeded_words(f"{self.seed}:gsp:q:{round_}:{g}:{q}", p.question_tokens)
                yield (
                    completion_spec(
                        f"gsp-{index:07d}",
                        self._systems[g],
                        question,
                        num_tokens,
                        p.output_tokens,
                        f"gsp-{g}",
                    ),
                )
                index += 1
            round_ += 1


@dataclass(frozen=True, slots=True)
class PrefixRepetitionParams:
    """vLLM ``bench serve --dataset-name prefix_repetition`` defaults."""

    num_prefixes: int = 10
    prefix_tokens: int = 256
    suffix_tokens: int = 256
    output_tokens: int = 128

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in self.__dataclass_fields__.values()))


class PrefixRepetition(Workload):
    """A few short prefixes, each followed by a unique suffix."""

    name = "prefix-repetition"
    defaults = WorkloadDefaults(mode="open", max_concurrency=16, num_requests=1000)
    params: PrefixRepetitionParams

    def __init__(self, params: PrefixRepetitionParams | None = None, seed: int = 0) -> None:
        super().__init__(params or PrefixRepetitionParams(), seed)

    def sessions(self) -> Iterator[Session]:
        p, rng = self.params, random.Random(self.seed)
        prefixes = [
            seeded_words(f"{self.seed}:prefix-rep:{k}", p.prefix_tokens)
            for k in range(p.num_prefixes)
        ]
        num_tokens = p.prefix_tokens + p.suffix_tokens
        index = 0
        while True:
            order = list(range(p.num_prefixes))
            rng.shuffle(order)
            for k in order:
                suffix = seeded_words(f"{self.seed}:prefix-rep:suffix:{index}", p.suffix_tokens)
                spec = completion_spec(
                    f"prefix-rep-{index:07d}",
                    prefixes[k],
                    suffix,
                    num_tokens,
                    p.output_tokens,
                    f"prefix-{k}",
                )
                yield (spec,)
                index += 1


@dataclass(frozen=True, slots=True)
class B2bParams:
    """llm-d B2B scenario (inference-perf shared-prefix generator) defaults."""

    num_groups: int = 150
    users_per_group: int = 5  # each user has one fixed question
    context_tokens: int = 6000  # shared per group
    question_tokens: int = 1200
    output_tokens: int = 1000

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in self.__dataclass_fields__.values()))


class B2b(Workload):
    """Large shared contexts, few users each: the shared part outgrows one replica's cache."""

    name = "b2b"
    defaults = WorkloadDefaults(mode="open", rates=(3.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0))
    params: B2bParams

    def __init__(self, params: B2bParams | None = None, seed: int = 0) -> None:
        super().__init__(params or B2bParams(), seed)
        self._contexts: dict[int, str] = {}  # built lazily: 150 x 6,000 words is large
        self._questions: dict[tuple[int, int], str] = {}

    def _context(self, g: int) -> str:
        if g not in self._contexts:
            self._contexts[g] = seeded_words(f"{self.seed}:b2b:ctx:{g}", self.params.context_tokens)
        return self._contexts[g]

    def _question(self, g: int, u: int) -> str:
        if (g, u) not in self._questions:
            text = seeded_words(f"{self.seed}:b2b:q:{g}:{u}", self.params.question_tokens)
            self._questions[(g, u)] = text
        return self._questions[(g, u)]

    def sessions(self) -> Iterator[Session]:
        p, rng = self.params, random.Random(self.seed)
        num_tokens = p.context_tokens + p.question_tokens
        index = 0
        while True:
            g, u = rng.randrange(p.num_groups), rng.randrange(p.users_per_group)
            spec = completion_spec(
                f"b2b-{index:07d}",
                self._context(g),
                self._question(g, u),
                num_tokens,
                p.output_tokens,
                f"b2b-{g}",
            )
            yield (spec,)
            index += 1
