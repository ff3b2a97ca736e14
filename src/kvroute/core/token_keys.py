"""Exact-mode keys: the prompt's token ids as the engine will see them, cut into blocks.

In exact mode the router's keys must be computed over exactly the engine's token ids
(``core/event_model.py`` keys the engine's blocks from the token ids in its events). A
``PromptTokenizer`` turns a request body into those ids: ``BuiltinPromptTokenizer`` for
the simulator (``render_chat`` + the built-in tokenizer, as ``sim/protocol.py`` does);
``router/hf_tokenizer.py`` loads a real model's ``tokenizer.json`` and chat template.

Tokenizing costs real time (about 7 ms for 32k tokens, 1 ms for 3.7k, mostly the
built-in tokenizer's regex): the proxy calls this only when
``Fleet.key_kind_for(model) == "tokens"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.common.tokenizer import default_tokenizer
from kvroute.core.keys import Prompt, prompt_of


class PendingIds(Protocol):
    """A prompt's tokenization begun: ``finish`` gives the ids; ``new_chars``: how much
    text it still has to encode (the rest was cached), which tells the router whether
    ``finish`` is worth a thread."""

    new_chars: int

    def finish(self) -> Sequence[int]: ...


class PromptTokenizer(Protocol):
    """Token ids of a request body's prompt, as the engine computes them.

    ``start`` does the cheap part (parse, render, look up what was tokenized before) and
    raises ``PromptError`` (a ValueError) when the body has no readable prompt.
    ``off_loop``: ``finish`` releases the GIL for the long part of its work, so the router
    runs it in a thread when much text is new and keeps serving meanwhile.
    """

    off_loop: bool

    def start(self, body: dict[str, Any], chat: bool) -> PendingIds: ...


@dataclass(frozen=True, slots=True)
class ReadyIds:
    """``PendingIds`` with nothing left to do."""

    ids: Sequence[int]
    new_chars: int = 0

    def finish(self) -> Sequence[int]:
        return self.ids


class BuiltinPromptTokenizer:
    """The simulator's tokenization: chat rendered by ``render_chat``, the built-in vocab."""

    off_loop = False  # pure Python: a thread would hold the GIL all the same

    def start(self, body: dict[str, Any], chat: bool) -> ReadyIds:
        return ReadyIds(self.token_ids(body, chat))

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        return prompt_token_ids(prompt_of(body, chat))


def prompt_token_ids(prompt: Prompt) -> list[int]:
    """Ids of an already parsed prompt with the built-in tokenizer (given ids pass through)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    assert prompt.text is not None, "Prompt holds text or token ids"
    return default_tokenizer().encode(prompt.text)


def exact_route_keys(
    token_ids: Sequence[int], block_size: int, seed: int = ROOT_SEED
) -> tuple[list[int], int]:
    """(block keys, prompt tokens) for a RouteRequest in exact mode."""
    return token_block_hashes(token_ids, block_size, seed), len(token_ids)
