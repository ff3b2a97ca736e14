"""A fast, deterministic built-in tokenizer (no downloads).

It stands in for a model's BPE tokenizer wherever kvroute needs token ids without a
real model: the simulated engine, the router's keys for simulated fleets, and the
benchmark's token counts. On English-like text it averages about four characters per
token, like the BPE tokenizers of Llama-class models.

A token is one piece matched by ``_PIECE``: an optional leading space followed by up to
four letters, up to three digits, or one other symbol; or a run of whitespace. A
piece's id is a hash of its text, so the same text always gives the same ids, across
processes and machines, whatever the tokenizer saw before. Ids below ``NUM_SPECIAL`` are
never produced by hashing.

Pieces are cached only to skip rehashing and to let ``decode`` map ids back. The cache is
bounded (clients choose the text): at most ``max_cached_pieces`` learned pieces of up to
``MAX_CACHED_PIECE_CHARS`` characters per generation, two generations kept; when the
current one is full it becomes the old one and the oldest is dropped. ``OUTPUT_WORDS``
are pinned. So ``decode`` returns the output words, and any other piece only while it
is cached: generated text always round-trips, a client's prompt need not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import cast

import xxhash

VOCAB_SIZE = 32_000
NUM_SPECIAL = 16  # ids 0..15 are never produced (room for BOS, EOS, padding)
MAX_CACHED_PIECES = 1 << 15  # learned pieces per cache generation (two are kept)
MAX_CACHED_PIECE_CHARS = 64  # longer pieces (whitespace runs) are hashed, never cached

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
    """Deterministic text -> token ids; ``decode`` inverts the pieces it has cached."""

    def __init__(self, max_cached_pieces: int = MAX_CACHED_PIECES) -> None:
        if max_cached_pieces < 1:
            raise ValueError(f"max_cached_pieces must be >= 1, got {max_cached_pieces}")
        self.max_cached_pieces = max_cached_pieces
        self._pinned: dict[str, int] = {" " + w: _piece_id(" " + w) for w in OUTPUT_WORDS}
        self._pinned_ids = {i: p for p, i in reversed(self._pinned.items())}
        # current generation (pinned words included) and the one before it
        self._piece_to_id = dict(self._pinned)
        self._id_to_piece = dict(self._pinned_ids)
        self._old_piece_to_id: dict[str, int] = {}
        self._old_id_to_piece: dict[int, str] = {}

    @property
    def num_cached_pieces(self) -> int:
        """Entries in both generations, each of which holds the pinned words: at most
        ``2 * (max_cached_pieces + len(OUTPUT_WORDS))``."""
        return len(self._piece_to_id) + len(self._old_piece_to_id)

    def _learn(self, piece: str) -> int:
        """Id of a piece missing from the current generation; caches it when short."""
        token_id = self._old_piece_to_id.get(piece)
        if token_id is None:
            token_id = _piece_id(piece)
        if len(piece) <= MAX_CACHED_PIECE_CHARS:
            if len(self._piece_to_id) - len(self._pinned) >= self.max_cached_pieces:
                self._old_piece_to_id, self._old_id_to_piece = self._piece_to_id, self._id_to_piece
                self._piece_to_id = dict(self._pinned)
                self._id_to_piece = dict(self._pinned_ids)
            self._piece_to_id[piece] = token_id
            # First writer wins on a hash collision: the pinned words always do.
            self._id_to_piece.setdefault(token_id, piece)
        return token_id

    def encode(self, text: str) -> list[int]:
        pieces = _pieces(text)
        # known pieces in one C pass; then the unknown ones, learnt in order (a rotation
        # mid-text leaves the lookup above on the old generation, as before)
        found: list[int | None] = list(map(self._piece_to_id.get, pieces))
        if None not in found:
            return cast(list[int], found)
        learn = self._learn
        return [learn(p) if t is None else t for p, t in zip(pieces, found, strict=True)]

    def count(self, text: str) -> int:
        """Number of tokens of ``text``, without building the id list (one C pass per
        slice: counting matches one by one in Python took 2.4x as long)."""
        return len(_pieces(text))

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids``; an id whose piece is not cached decodes to ""."""
        new, old = self._id_to_piece, self._old_id_to_piece
        return "".join(new.get(t) or old.get(t, "") for t in token_ids)

    def word_ids(self) -> Sequence[int]:
        """Ids of ``OUTPUT_WORDS`` (with leading space), for generating output."""
        return [self._pinned[" " + w] for w in OUTPUT_WORDS]


def _piece_id(piece: str) -> int:
    return NUM_SPECIAL + xxhash.xxh32_intdigest(piece.encode()) % (VOCAB_SIZE - NUM_SPECIAL)


_SLICE_CHARS = 1 << 16
SAFE_CUT = re.compile(r"(?<=\S) (?=\S)")  # no piece spans a space between two non-spaces


def _pieces(text: str) -> list[str]:
    """``_PIECE.findall(text)`` in slices of about 64K characters, cut where no piece
    spans: one C call on a megabyte prompt would hold the GIL for 0.1 s, so a thread
    tokenizing it (the router's, for big prompts) gives the event loop a turn between
    slices."""
    if len(text) <= _SLICE_CHARS:
        return _PIECE.findall(text)
    out: list[str] = []
    start = 0
    while start < len(text):
        cut = SAFE_CUT.search(text, start + _SLICE_CHARS)
        end = cut.start() if cut else len(text)
        out += _PIECE.findall(text, start, end)
        start = end
    return out


_default: Tokenizer | None = None


def default_tokenizer() -> Tokenizer:
    """The process-wide built-in tokenizer (its bounded piece cache is shared)."""
    global _default
    if _default is None:
        _default = Tokenizer()
    return _default
