"""One request's state inside the engine (nano-vllm's Sequence, vLLM's Request)."""

from __future__ import annotations

import enum
from array import array
from collections.abc import MutableSequence, Sequence


class RequestStatus(enum.Enum):
    """Where a request is: waiting (new or preempted), running, or finished."""

    WAITING = "waiting"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputed from scratch later
    RUNNING = "running"
    FINISHED_LENGTH = "finished_length"  # reached max_tokens
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """Token ids, progress and KV blocks of one request.

    Like vLLM V1 there are no prefill and decode phases: each step lets
    ``num_computed_tokens`` catch up with ``num_tokens`` (prompt + output so far).
    A request whose computed tokens reach ``num_tokens`` samples one more token.
    """

    __slots__ = (
        "block_hashes",
        "block_table",
        "cache_salt",
        "hash_seed",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "request_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        block_hashes: list[int],
        hash_seed: int,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id  # caller's id, unique among unfinished requests
        # prompt, then output tokens; 64-bit ids given as an array stay one (no int objects)
        self.token_ids: MutableSequence[int] = (
            array("Q", prompt_token_ids)
            if isinstance(prompt_token_ids, array)
            else list(prompt_token_ids)
        )
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens  # output tokens to produce (finish "length")
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in (or scheduled into) the cache
        self.block_table: list[int] = []  # KV block ids, in token order
        self.block_hashes = block_hashes  # chained hashes of the full blocks known so far
        self.hash_seed = hash_seed  # parent of the first block's hash (salt/extra keys)
        self.cache_salt = cache_salt  # in the first block's extra keys of its KV events
        self.num_cached_blocks = 0  # leading blocks of block_table registered in the cache
        self.num_cached_tokens: int | None = None  # prefix hit at first scheduling, tokens
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_table})"
        )
