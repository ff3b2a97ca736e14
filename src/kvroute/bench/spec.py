"""One benchmark request as a pure value, and the deterministic synthetic text it carries.

A workload produces ``RequestSpec`` values and nothing else: no sockets, no clock, no
global random. The HTTP load generator turns a spec into a POST; the discrete-event
simulator feeds ``prompt_text()`` to its engines (tokenized, or as the ``prompt_token_ids``
a trace replay made with it). Both therefore see the same requests.

Sizes are exact in tokens of ``kvroute.common.tokenizer``: synthetic text is a run of
``OUTPUT_WORDS`` joined by single spaces, and each such word (four letters at most) is
one token, so ``n`` words are ``n`` tokens.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvroute.common.chat import render_chat
from kvroute.common.tokenizer import OUTPUT_WORDS, default_tokenizer

ENDPOINT_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}


def words_text(rng: random.Random, num_tokens: int) -> str:
    """``num_tokens`` words drawn from ``rng``: exactly ``num_tokens`` tokens, no edge spaces."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return " ".join(rng.choices(OUTPUT_WORDS, k=num_tokens))


def seeded_words(key: str, num_tokens: int) -> str:
    """Text that depends only on ``key`` (a stable string seed), e.g. ``"7:gsp:sys:3"``."""
    return words_text(random.Random(key), num_tokens)


@functools.lru_cache(maxsize=8192)
def count_tokens(text: str) -> int:
    """Token count of ``text``; cached because shared prefixes are counted again and again."""
    return default_tokenizer().count(text)


def chat_prompt_tokens(messages: tuple[tuple[str, str], ...]) -> int:
    """Tokens of ``render_chat(messages)``, summed per message so shared parts hit the cache.

    Exact when no content starts or ends with whitespace (true for all generated text):
    then no tokenizer piece spans a template boundary.
    """
    return count_tokens("<|assistant|>\n") + sum(message_tokens(*m) for m in messages)


def message_tokens(role: str, content: str) -> int:
    """Tokens of one rendered message, ``<|role|>\\n`` + content + ``\\n`` (as
    ``chat_prompt_tokens`` counts it)."""
    return count_tokens(f"<|{role}|>\n") + count_tokens(content) + 1


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, independent of how and when it is sent."""

    request_id: str  # unique within one workload stream, e.g. "gsp-000123"
    endpoint: str  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    messages: tuple[tuple[str, str], ...] | None  # chat: (role, content) pairs; else None
    prompt: str | None  # completions: the prompt text; else None
    max_tokens: int  # output tokens asked for
    num_prompt_tokens: int  # prompt tokens under the built-in tokenizer (chat: rendered)
    prefix_group: str  # label of the shared prefix this request uses (stickiness key)
    session_id: str | None = None  # multi-turn: the conversation; None for lone requests
    turn: int = 0  # position in its session, 0-based
    arrival_s: float | None = None  # trace replay: send time from run start; None: load decides
    think_time_s: float = 0.0  # pause after the previous turn of the session, before this one
    headers: tuple[tuple[str, str], ...] = ()  # extra HTTP headers (name, value), e.g. a session id
    # completions: the prompt's ids under the built-in tokenizer, when the workload made
    # them with the text (trace replays), so the simulator need not tokenize 145M tokens;
    # never sent, not compared, not in ``to_json``
    prompt_token_ids: Sequence[int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of messages (chat) and prompt (completions) is set")
        if (self.endpoint == "chat") != (self.messages is not None):
            raise ValueError("chat requests carry messages, completions requests a prompt")
        if self.prompt_token_ids is not None and self.prompt is None:
            raise ValueError("prompt_token_ids come with a prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.think_time_s < 0:
            raise ValueError("think_time_s must be >= 0")
        if any(not name or ":" in name for name, _ in self.headers):
            raise ValueError("header names must be non-empty and have no ':'")

    @classmethod
    def chat(
        cls,
        request_id: str,
        messages: tuple[tuple[str, str], ...],
        max_tokens: int,
        prefix_group: str,
        **extra: Any,
    ) -> RequestSpec:
        """A chat request; its prompt tokens counted under the built-in chat template."""
        return cls(
            request_id=request_id,
            endpoint="chat",
            messages=messages,
            prompt=None,
            max_tokens=max_tokens,
            num_prompt_tokens=chat_prompt_tokens(messages),
            prefix_group=prefix_group,
            **extra,
        )

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]

    def prompt_text(self) -> str:
        """The text the engine tokenizes (the simulator's chat template for chat)."""
        if self.messages is not None:
            return render_chat([{"role": r, "content": c} for r, c in self.messages])
        assert self.prompt is not None, "RequestSpec holds messages or a prompt"
        return self.prompt

    def body(
        self, model: str | None, *, stream: bool = True, ignore_eos: bool = False
    ) -> dict[str, Any]:
        """The OpenAI request body; usage is asked for in the stream, as vLLM's bench does."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": stream}
        if model is not None:
            body["model"] = model
        if self.messages is not None:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        else:
            body["prompt"] = self.prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def to_json(self) -> str:
        """Canonical JSON of the spec (used to check determinism byte for byte).

        ``headers`` appears only when set, so specs without headers keep their bytes.
        """
        fields = asdict(replace(self, prompt_token_ids=None))
        del fields["prompt_token_ids"]
        if not self.headers:
            del fields["headers"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


Session = tuple[RequestSpec, ...]  # turns of one conversation, in order; lone requests: 1 turn
