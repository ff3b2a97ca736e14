"""A fast, deterministic built-in tokenizer (no downloads).

It stands in for a model's BPE tokenizer wherever kvroute needs token ids without a
real model: the simulated engine, the router's keys for simulated fleets, and the
benchmark's token counts. On English-like text it averages about four characters per
token, like the BPE tokenizers of Llama-class models.

A token is one piece matched by ``_PIECE``: an optional leading space followed by up to
four letters, up to three digits, or one other symbol; or a run of whitespace. A
piece's id is a hash of its text, so the same text always gives the same ids, across
processes and machines. Ids below ``NUM_SPECIAL`` are never produced by hashing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import xxhash

VOCAB_SIZE = 32_000
NUM_SPECIAL = 16
BOS_ID = 1
EOS_ID = 2

_PIECE = re.compile(r" ?[A-Za-z]{1,4}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s+")

# Words used for generated output and synthetic prompts: each is one token with its
# leading space, so a text of n such words is exactly n tokens.
OUTPUT_WORDS: tuple[str, ...] = (
    "the",
    "and",
    "for",
    "with",
    "that",
    "this",
    "from",
    "will",
    "have",
    "are",
    "data",
    "code",
    "time",
    "call",
    "file",
    "list",
    "node",
    "test",
    "path",
    "key",
    "run",
    "set",
    "get",
    "map",
    "user",
    "line",
    "case",
    "type",
    "page",
    "step",
    "each",
    "when",
    "then",
    "else",
    "into",
    "over",
    "only",
    "also",
    "more",
    "some",
)


class Tokenizer:
    """Deterministic text <-> token ids; ``decode(encode(t)) == t`` for any text."""

    def __init__(self) -> None:
        self._piece_to_id: dict[str, int] = {}
        self._id_to_piece: dict[int, str] = {}
        for word in OUTPUT_WORDS:
            self._intern(" " + word)

    def _intern(self, piece: str) -> int:
        token_id = NUM_SPECIAL + xxhash.xxh32_intdigest(piece.encode()) % (VOCAB_SIZE - NUM_SPECIAL)
        self._piece_to_id[piece] = token_id
        # First writer wins on a hash collision; decode is only needed for our own text.
        self._id_to_piece.setdefault(token_id, piece)
        return token_id

    def encode(self, text: str) -> list[int]:
        lookup = self._piece_to_id.get
        ids = []
        for piece in _PIECE.findall(text):
            token_id = lookup(piece)
            ids.append(self._intern(piece) if token_id is None else token_id)
        return ids

    def count(self, text: str) -> int:
        """Number of tokens of ``text``, without building the id list."""
        return sum(1 for _ in _PIECE.finditer(text))

    def decode(self, token_ids: Iterable[int]) -> str:
        pieces = self._id_to_piece
        return "".join(pieces.get(t, "") for t in token_ids)

    def word_ids(self) -> Sequence[int]:
        """Ids of ``OUTPUT_WORDS`` (with leading space), for generating output."""
        return [self._piece_to_id[" " + w] for w in OUTPUT_WORDS]


_default: Tokenizer | None = None


def default_tokenizer() -> Tokenizer:
    """The process-wide built-in tokenizer (its piece cache is shared)."""
    global _default
    if _default is None:
        _default = Tokenizer()
    return _default
