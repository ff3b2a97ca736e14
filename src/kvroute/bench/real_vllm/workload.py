"""The real-vLLM run's workload: shared-prefix chats, and the ceiling an infinite cache
would reach on them (from vLLM's own token ids)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.bench.workloads import make_workload


@dataclass(frozen=True, slots=True)
class Workload:
    """The shared-prefix chat workload (zipf-hot with near-uniform popularity)."""

    num_prompts: int  # distinct system prompts
    prefix_tokens: int  # words per system prompt (about one BPE token each)
    suffix_tokens: int  # words of each unique user message
    output_tokens: int  # max_tokens, with ignore_eos
    requests: int  # measured requests per mode
    concurrency: int  # closed-loop users
    seed: int  # workload seed (same prompts in every mode)

    def params(self) -> dict[str, str]:
        return {
            "num_prefixes": str(self.num_prompts),
            "prefix_tokens": str(self.prefix_tokens),
            "suffix_tokens": str(self.suffix_tokens),
            "output_tokens": str(self.output_tokens),
            "zipf_s": "0.01",  # near-uniform popularity
        }

    def bench_args(self, stream: bool = True) -> list[str]:
        args = ["--workload", "zipf-hot", "--seed", str(self.seed)]
        for key, value in self.params().items():
            args += ["--workload-arg", f"{key}={value}"]
        args += ["--concurrency", str(self.concurrency), "--num-requests", str(self.requests)]
        args += [] if stream else ["--no-stream"]
        return [*args, "--ignore-eos", "--no-plots", "--quiet", "--timeout", "120"]

    def messages(self) -> Iterator[list[dict[str, str]]]:
        """The chat messages of the measured requests, in the order they are sent."""
        made = make_workload("zipf-hot", seed=self.seed, overrides=self.params())
        n = 0
        for session in made.sessions():
            for spec in session:
                if n == self.requests:
                    return
                assert spec.messages is not None, "zipf-hot sends chat requests"
                yield [{"role": r, "content": c} for r, c in spec.messages]
                n += 1


def ceiling_hit_rate(token_lists: list[list[int]], block_size: int) -> float:
    """The engine hit rate with an infinite cache: each request hits every full block of
    its prefix that an earlier request computed (vLLM recomputes at least the last
    token, so a prompt never hits whole)."""
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for ids in token_lists:
        usable = (len(ids) - 1) // block_size  # blocks that may be hits
        matched = 0
        while matched < usable and tuple(ids[: (matched + 1) * block_size]) in seen:
            matched += 1
        hits += matched * block_size
        queries += len(ids)
        for k in range(1, len(ids) // block_size + 1):
            seen.add(tuple(ids[: k * block_size]))
    return hits / queries if queries else 0.0
