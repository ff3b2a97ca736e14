"""Seeded blocks of words, text and token ids together, many blocks per numpy call.

A trace replay turns every block id of its trace into one block of ``OUTPUT_WORDS``,
``random.Random(key).choices(OUTPUT_WORDS, k=n)`` (the Mooncake conversation trace:
183k blocks, 94M words). ``Random.choices`` costs a Python call per word, and the
simulator then tokenizes the text again. Here each key still seeds a ``random.Random``
(so the seeding is ``random``'s own), but its raw 32-bit outputs come out in one
``getrandbits`` call, and ``random()``'s doubles, ``(a >> 5, b >> 6)`` of two outputs,
and ``choices``' indices ``floor(random() * n)`` are computed from them with numpy: the
same IEEE operations in the same order, so the same words. A block's text and its token
ids under the built-in tokenizer (each word is one token, common/tokenizer.py) are
built from the indices by table lookups. tests/bench/test_word_blocks.py checks both
against ``Random.choices`` and ``Tokenizer.encode``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvroute.common.tokenizer import OUTPUT_WORDS, Tokenizer

_TWO_26 = 67108864.0  # random(): (a * 2**26 + b) / 2**53
_TWO_MINUS_53 = 1.0 / 9007199254740992.0


def seeded_choice_indices(keys: Sequence[str], population_size: int, k: int) -> np.ndarray:
    """``(len(keys), k)`` indices: row i is the index of each word that
    ``random.Random(keys[i]).choices(population, k=k)`` picks from a population of
    ``population_size``."""
    if k < 0 or population_size < 1:
        raise ValueError("k must be >= 0 and population_size >= 1")
    raw = b"".join(random.Random(key).getrandbits(64 * k).to_bytes(8 * k, "little") for key in keys)
    words = np.frombuffer(raw, dtype="<u4").reshape(len(keys), k, 2)
    high = (words[..., 0] >> 5).astype(np.float64)
    low = (words[..., 1] >> 6).astype(np.float64)
    doubles = (high * _TWO_26 + low) * _TWO_MINUS_53
    return np.floor(doubles * float(population_size)).astype(np.intp)


class WordBlock:
    """One block: its words joined by single spaces, and their indices in ``OUTPUT_WORDS``."""

    __slots__ = ("indices", "text")

    def __init__(self, text: str, indices: bytes) -> None:
        self.text = text
        self.indices = indices  # one byte per word

    def head(self, num_words: int) -> str:
        """The text of the block's first ``num_words`` words."""
        if num_words >= len(self.indices):
            return self.text
        words = np.frombuffer(self.indices, np.uint8, num_words)
        return self.text[: int(_SPACED_LENGTHS.take(words).sum()) - 1]


_WORD_BYTES = [(" " + w).encode("ascii") for w in OUTPUT_WORDS]  # each word, then a space
_WIDTH = max(map(len, _WORD_BYTES))
_TABLE = np.zeros((len(OUTPUT_WORDS), _WIDTH), np.uint8)  # word + " ", zero padded
for _i, _w in enumerate(_WORD_BYTES):
    _TABLE[_i, : len(_w)] = np.frombuffer(_w[1:] + b" ", np.uint8)
_SPACED_LENGTHS = np.array([len(w) for w in _WORD_BYTES], np.int64)
_TOKENIZER = Tokenizer()  # ids are hashes of the pieces: any instance gives the same
_SPACED_IDS = np.array(_TOKENIZER.word_ids(), dtype=object)  # " word" -> its id
_FIRST_IDS = [_TOKENIZER.encode(w)[0] for w in OUTPUT_WORDS]  # "word" -> its id


def make_blocks(keys: Sequence[str], num_words: int) -> list[WordBlock]:
    """The block of each key: ``random.Random(key).choices(OUTPUT_WORDS, k=num_words)``."""
    indices = seeded_choice_indices(keys, len(OUTPUT_WORDS), num_words).astype(np.uint8)
    letters = _TABLE.take(indices, axis=0).reshape(-1)  # take: faster than [indices]
    text = letters[letters != 0].tobytes().decode("ascii")
    ends = np.cumsum(_SPACED_LENGTHS.take(indices).sum(axis=1)).tolist()
    raw = indices.tobytes()
    blocks = []
    start = 0
    for i, end in enumerate(ends):
        blocks.append(WordBlock(text[start : end - 1], raw[i * num_words : (i + 1) * num_words]))
        start = end
    return blocks


def prompt_token_ids(blocks: Sequence[WordBlock], num_words: int) -> list[int]:
    """Token ids of the first ``num_words`` words of ``blocks`` joined by spaces (the
    first word without a leading space): ``Tokenizer.encode`` of that text."""
    if num_words < 1:
        return []
    indices = np.frombuffer(b"".join(b.indices for b in blocks), np.uint8, num_words)
    ids: list[int] = _SPACED_IDS.take(indices).tolist()
    ids[0] = _FIRST_IDS[indices[0]]
    return ids


class WordBlockCache:
    """Blocks of ``num_words`` words by id, ``key_prefix + str(id)`` seeding each; least
    recently used dropped first beyond ``max_blocks``."""

    def __init__(self, key_prefix: str, num_words: int, max_blocks: int) -> None:
        self._prefix = key_prefix
        self._num_words = num_words
        self._max_blocks = max(1, max_blocks)
        self._blocks: OrderedDict[int, WordBlock] = OrderedDict()

    def get(self, block_ids: Sequence[int]) -> list[WordBlock]:
        """The blocks of ``block_ids``, the missing ones made in one batch."""
        cache = self._blocks
        missing = [b for b in dict.fromkeys(block_ids) if b not in cache]
        made: dict[int, WordBlock] = {}
        if missing:
            keys = [f"{self._prefix}{b}" for b in missing]
            made = dict(zip(missing, make_blocks(keys, self._num_words), strict=True))
        out = []
        for b in block_ids:
            block = cache.get(b)
            if block is None:
                block = cache[b] = made[b]
            else:
                cache.move_to_end(b)
            out.append(block)
        while len(cache) > self._max_blocks:
            cache.popitem(last=False)
        return out
