"""Routing keys: request body -> prompt -> chained block hashes.

The hashing itself (chained xxh3 keys of full blocks, the chain root of a salted
request) is ``common/hashing.py``, shared with the engine. This module reads a request
body's prompt and picks the granularity:

- text blocks of ``block_chars`` bytes of the UTF-8 prompt (approximate mode; about
  ``block_size * 4`` characters stand for one engine block of the built-in tokenizer;
  the router learns the engines' own bytes per token, core/calibration.py, and scales
  capacity and token counts rather than recutting keys, so the index stays valid);
- token blocks of ``block_size`` token ids (exact mode, same ids as the engine sees).

The chain's root is ``ROOT_SEED``, or ``chain_seed(cache_salt)`` for a request that
carries vLLM's ``cache_salt``: the engine mixes the salt into its first block's hash, so
salted requests share cache only with requests of the same salt, and their keys must
not match unsalted ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.common.chat import ChatFormatError, render_chat
from kvroute.common.hashing import (
    ROOT_SEED,
    byte_block_hashes,
    text_block_hashes,
    token_block_hashes,
)

CHARS_PER_TOKEN = 4
MAX_TOKEN_ID = (1 << 31) - 1  # engines hold ids as int32; no vocabulary comes near it
MAX_PROMPT_TOKEN_IDS = 1 << 24  # ids in one prompt: above any served context (10M)


class PromptError(ValueError):
    """A request body whose prompt or messages cannot be read; the message names the field."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the router routes on: the rendered text, or token ids when the client sent ids."""

    text: str | None
    token_ids: tuple[int, ...] | None

    @property
    def num_tokens_estimate(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        assert self.text is not None, "Prompt holds text or token ids"
        return max(1, len(self.text) // CHARS_PER_TOKEN)


def prompt_of(body: dict[str, Any], chat: bool) -> Prompt:
    """Extract the prompt of a ``/v1/chat/completions`` (chat) or ``/v1/completions`` body."""
    if chat:
        try:
            return Prompt(render_chat(body.get("messages"), body.get("tools")), None)
        except ChatFormatError as exc:
            raise PromptError(str(exc)) from None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        # A batch (list of strings or of id lists) is routed on its first prompt; the
        # others are checked too, so the engine never gets a batch the router calls valid.
        if type(first) is str and all(type(p) is str for p in prompt):
            return Prompt(first, None)
        if type(first) is int:
            return Prompt(None, _token_ids(prompt))
        if type(first) is list and all(type(p) is list for p in prompt):
            ids = [_token_ids(p) for p in prompt]
            return Prompt(None, ids[0])
    raise PromptError("'prompt' must be a string, a list of strings or a list of token ids")


def _token_ids(ids: list[Any]) -> tuple[int, ...]:
    """A non-empty list of token ids: ints (booleans are not) in [0, MAX_TOKEN_ID]."""
    if not ids or not all(type(t) is int for t in ids):
        raise PromptError("'prompt' must be a string, a list of strings or a list of token ids")
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise PromptError(f"'prompt' must hold at most {MAX_PROMPT_TOKEN_IDS} token ids")
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise PromptError(f"'prompt' token ids must lie in [0, {MAX_TOKEN_ID}]")
    return tuple(ids)


def salt_of(body: dict[str, Any]) -> str | None:
    """The body's ``cache_salt`` when it is a non-empty string (the engine rejects other
    values, so they route as unsalted and the engine's error is passed on)."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def text_route_keys(text: str, block_size: int, seed: int = ROOT_SEED) -> tuple[list[int], int]:
    """(``prompt_block_hashes`` of a text prompt, its UTF-8 length in bytes): the length
    is what approximate mode estimates tokens from (core/calibration.py)."""
    data = text.encode()
    return byte_block_hashes(data, block_size * CHARS_PER_TOKEN, seed), len(data)


def prompt_block_hashes(prompt: Prompt, block_size: int, seed: int = ROOT_SEED) -> list[int]:
    """Keys of ``prompt`` for an engine with ``block_size``-token blocks."""
    if prompt.token_ids is not None:
        return token_block_hashes(prompt.token_ids, block_size, seed)
    assert prompt.text is not None, "Prompt holds text or token ids"
    return text_block_hashes(prompt.text, block_size * CHARS_PER_TOKEN, seed)
