"""One request's state inside the engine (nano-vllm's Sequence, vLLM's Request)."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence


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


class HashedPrompt:
    """A prompt's token ids of which only those past its last full block are kept, with
    the length of the whole: what an engine given the prompt's block hashes reads of the
    ids (its length, the ids that later blocks will hash, the outputs it appends). For a
    caller that hashed the prompt already and does not want its ids copied and kept; ids
    of the hashed blocks cannot be read (IndexError), so an engine that publishes KV
    events (which carry them) needs the whole prompt."""

    __slots__ = ("_start", "_tail")

    def __init__(self, num_tokens: int, tail: Sequence[int]) -> None:
        if not 0 <= len(tail) <= num_tokens:
            raise ValueError("the tail is longer than the prompt")
        self._start = num_tokens - len(tail)  # index of the tail's first id
        self._tail = list(tail)

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int) -> HashedPrompt:
        """``token_ids`` with the ids of its full ``block_size``-token blocks dropped."""
        n = len(token_ids)
        return cls(n, token_ids[n - n % block_size :])

    def __len__(self) -> int:
        return self._start + len(self._tail)

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, step = index.indices(len(self))
        if step != 1 or (start < self._start and start < stop):
            raise IndexError(f"ids before {self._start} were hashed and not kept")
        return self._tail[start - self._start : max(start, stop) - self._start]

    def append(self, token_id: int) -> None:
        self._tail.append(token_id)

    def extend(self, token_ids: Iterable[int]) -> None:
        self._tail.extend(token_ids)

    def copy(self) -> HashedPrompt:
        return HashedPrompt(len(self), self._tail)


PromptIds = Sequence[int] | HashedPrompt  # what an engine takes as a prompt's ids


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
        prompt_token_ids: PromptIds,
        max_tokens: int,
        block_hashes: list[int],
        hash_seed: int,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id  # caller's id, unique among unfinished requests
        # prompt, then output tokens: a copy of the caller's, of the same kind where the
        # kind saves work (an array of 64-bit ids makes no int objects; a HashedPrompt
        # keeps only the ids not hashed yet)
        self.token_ids: list[int] | array[int] | HashedPrompt
        if isinstance(prompt_token_ids, HashedPrompt):
            self.token_ids = prompt_token_ids.copy()
        elif isinstance(prompt_token_ids, array):
            self.token_ids = array(prompt_token_ids.typecode, prompt_token_ids)
        else:
            self.token_ids = list(prompt_token_ids)
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
