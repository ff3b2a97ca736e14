"""Prompt text to token ids, fast: the built-in tokenizer over cached chunks.

A simulation tokenizes every prompt it sends, and most of a prompt is a prefix many
others share (a system prompt, a document, the conversation so far). The text is cut
into chunks at places no token spans (a space between two non-spaces: the built-in
tokenizer's own cut, common/tokenizer.py) and each chunk's ids are cached by its text,
so a prompt costs a dict lookup per shared chunk. Cuts are at the first such place
after every ``chunk_chars`` characters counted from the start, so two prompts that share
a prefix share its chunks. The ids equal ``Tokenizer.encode`` of the whole text
(tests/des/test_prompts.py). The cache is bounded in characters, least recently used
chunks dropped first.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import cast

from kvroute.common.tokenizer import SAFE_CUT, Tokenizer, default_tokenizer

# text of short words between single spaces: each word is one token of the built-in
# tokenizer (its piece ``" ?[A-Za-z]{1,4}"``), so splitting on spaces tokenizes it
_WORDS = re.compile(r" ?[A-Za-z]{1,4}(?: [A-Za-z]{1,4})*")


class PromptEncoder:
    """``encode(text)`` equal to the tokenizer's, with a chunk cache (module doc)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        chunk_chars: int = 2048,
        max_cached_chars: int = 64 << 20,
    ) -> None:
        if chunk_chars < 1 or max_cached_chars < 0:
            raise ValueError("chunk_chars must be >= 1 and max_cached_chars >= 0")
        self._tokenizer = tokenizer or default_tokenizer()
        self._chunk_chars = chunk_chars
        self._max_chars = max_cached_chars
        self._chunks: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._spaced_ids: dict[str, int] = {}  # word -> id of the piece " word"

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start, size, n = 0, self._chunk_chars, len(text)
        while start < n:
            cut = SAFE_CUT.search(text, start + size) if start + size < n else None
            end = cut.start() if cut else n
            ids += self._chunk(text[start:end])
            start = end
        return ids

    def _chunk(self, chunk: str) -> tuple[int, ...]:
        cached = self._chunks.get(chunk)
        if cached is not None:
            self._chunks.move_to_end(chunk)
            return cached
        if _WORDS.fullmatch(chunk):
            ids = self._words(chunk)
        else:
            ids = tuple(self._tokenizer.encode(chunk))
        if len(chunk) <= self._max_chars:
            self._chunks[chunk] = ids
            self._chars += len(chunk)
            while self._chars > self._max_chars:
                old, _ = self._chunks.popitem(last=False)
                self._chars -= len(old)
        return ids

    def _words(self, chunk: str) -> tuple[int, ...]:
        """Ids of a text ``_WORDS`` matches: one per word (the first without its space
        when the text does not start with one)."""
        words = chunk.split(" ")
        first = words[0]
        found = list(map(self._spaced_ids.get, words[1:]))  # " word" by its word
        ids = [self._tokenizer.encode(first)[0]] if first else []
        if None not in found:
            return (*ids, *cast(list[int], found))
        for word, token_id in zip(words[1:], found, strict=True):
            if token_id is None:
                token_id = self._spaced_ids[word] = self._tokenizer.encode(" " + word)[0]
            ids.append(token_id)
        return tuple(ids)
