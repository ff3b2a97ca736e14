"""``ranvier-stress``: the request mix behind Ranvier's published numbers (docs/workloads.md).

Each request is drawn independently: 10 % one of 5 fixed short prompts (no system
message); 20 % "medium" (with probability ``prefix_ratio`` one of 2 system prompts plus
one of 6 user prompts, else a unique prompt ending in a random number); 30 % "large"
(a large prefix under 4,000 tokens as system message plus a fixed user message); 40 %
"xlarge" (a large prefix of 4,000 tokens or more plus another fixed user message). Each
large prefix starts with its own "[Context ID: N]" line. About 70 % of the traffic is
therefore a handful of byte-identical prompts: that is what this workload tests.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.bench.spec import RequestSpec, Session, count_tokens, seeded_words
from kvroute.bench.workloads.base import Workload, WorkloadDefaults, check_positive

BUCKETS = ("short", "medium", "large", "xlarge")


@dataclass(frozen=True, slots=True)
class RanvierStressParams:
    """Sizes in tokens; defaults follow Ranvier's Locust file (docs/workloads.md)."""

    mix: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)  # shares of short, medium, large, xlarge
    prefix_ratio: float = 0.9  # medium: probability of a shared system prompt
    num_short_prompts: int = 5  # fixed short prompts
    short_prompt_tokens: int = 16
    num_medium_systems: int = 2  # system prompts (Ranvier: coding, analysis)
    medium_system_tokens: int = 64
    num_medium_users: int = 6  # user prompts paired with a medium system prompt
    medium_user_tokens: int = 32
    unique_prompt_tokens: int = 64  # medium without a shared system prompt
    large_prefix_tokens: tuple[int, ...] = (2000, 3500, 5000, 6500, 8000)  # one per prefix
    xlarge_min_tokens: int = 4000  # prefixes at least this long serve the xlarge bucket
    user_message_tokens: int = 32  # the fixed user message of large (and of xlarge)
    max_tokens: int = 100

    def __post_init__(self) -> None:
        if len(self.mix) != 4 or any(m < 0 for m in self.mix) or sum(self.mix) <= 0:
            raise ValueError("RanvierStressParams.mix must be 4 non-negative shares")
        if not 0.0 <= self.prefix_ratio <= 1.0:
            raise ValueError("RanvierStressParams.prefix_ratio must be in [0, 1]")
        check_positive(
            self,
            "num_short_prompts",
            "short_prompt_tokens",
            "num_medium_systems",
            "medium_system_tokens",
            "num_medium_users",
            "medium_user_tokens",
            "unique_prompt_tokens",
            "user_message_tokens",
            "max_tokens",
        )
        large = [t for t in self.large_prefix_tokens if t < self.xlarge_min_tokens]
        xlarge = [t for t in self.large_prefix_tokens if t >= self.xlarge_min_tokens]
        if (self.mix[2] > 0 and not large) or (self.mix[3] > 0 and not xlarge):
            raise ValueError(
                "RanvierStressParams.large_prefix_tokens needs prefixes on both sides of "
                "xlarge_min_tokens"
            )


def _texts(key: str, count: int, num_tokens: int) -> list[str]:
    return [seeded_words(f"{key}:{i}", num_tokens) for i in range(count)]


class RanvierStress(Workload):
    """Ranvier's "stress" distribution; closed loop, 30 users, think time U(0.5, 2) s."""

    name = "ranvier-stress"
    defaults = WorkloadDefaults(mode="closed", num_users=30, think_time_s=(0.5, 2.0))
    params: RanvierStressParams

    def __init__(self, params: RanvierStressParams | None = None, seed: int = 0) -> None:
        super().__init__(params or RanvierStressParams(), seed)
        p, key = self.params, f"{seed}:ranvier"
        self._short = _texts(f"{key}:short", p.num_short_prompts, p.short_prompt_tokens)
        self._systems = _texts(f"{key}:sys", p.num_medium_systems, p.medium_system_tokens)
        self._users = _texts(f"{key}:user", p.num_medium_users, p.medium_user_tokens)
        self._large = [self._large_prefix(i, n) for i, n in enumerate(p.large_prefix_tokens)]
        self._large_user = seeded_words(f"{key}:large-user", p.user_message_tokens)
        self._xlarge_user = seeded_words(f"{key}:xlarge-user", p.user_message_tokens)

    def _large_prefix(self, index: int, num_tokens: int) -> str:
        header = f"[Context ID: {index}]\n"
        body_tokens = num_tokens - count_tokens(header)
        if body_tokens < 1:
            raise ValueError(f"large prefix of {num_tokens} tokens is shorter than its header")
        return header + seeded_words(f"{self.seed}:ranvier:large:{index}", body_tokens)

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self.seed)
        index = 0
        while True:
            bucket = rng.choices(BUCKETS, weights=self.params.mix)[0]
            yield (self._draw(bucket, rng, index),)
            index += 1

    def _draw(self, bucket: str, rng: random.Random, index: int) -> RequestSpec:
        p = self.params
        if bucket == "short":
            i = rng.randrange(len(self._short))
            return self._spec(index, (("user", self._short[i]),), f"short-{i}")
        if bucket == "medium":
            if rng.random() < p.prefix_ratio:
                s, u = rng.randrange(len(self._systems)), rng.randrange(len(self._users))
                messages = (("system", self._systems[s]), ("user", self._users[u]))
                return self._spec(index, messages, f"medium-sys-{s}")
            text = seeded_words(f"{self.seed}:ranvier:unique:{index}", p.unique_prompt_tokens - 1)
            text += f" {rng.randrange(1000)}"  # one token: a space and up to three digits
            return self._spec(index, (("user", text),), f"unique-{index}")
        limit = p.xlarge_min_tokens
        if bucket == "large":
            choices = [i for i, n in enumerate(p.large_prefix_tokens) if n < limit]
            user = self._large_user
        else:
            choices = [i for i, n in enumerate(p.large_prefix_tokens) if n >= limit]
            user = self._xlarge_user
        k = rng.choice(choices)
        return self._spec(index, (("system", self._large[k]), ("user", user)), f"large-{k}")

    def _spec(self, index: int, messages: tuple[tuple[str, str], ...], group: str) -> RequestSpec:
        return RequestSpec.chat(f"ranvier-{index:07d}", messages, self.params.max_tokens, group)
