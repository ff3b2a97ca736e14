"""Issue 9, finding 3: the built-in tokenizer's memory is bounded, its ids unchanged.

Ids are a hash of each piece's text, so a cache of pieces can only change speed and
``decode``; these tests pin the ids computed before the cache was bounded.
"""

from __future__ import annotations

import random
import tracemalloc
from array import array

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.chat import render_chat
from kvroute.common.tokenizer import OUTPUT_WORDS, Tokenizer

# (text, xxh64 of its ids packed as uint64, number of ids): computed with the unbounded
# tokenizer before this change (commit 8101351).
PINNED = [
    ("hello world 42!", 8375560507651882478, 6),
    (
        "Prefix caching lets an inference engine reuse the attention keys and values.",
        11459722491950646784,
        22,
    ),
    ("def f(x):\n    return x ** 2  # square\n\n\tindented\ttabs\r\n", 5390176356191499816, 23),
    ("Ünïcödé façade — naïve café, 東京 日本語, emoji 🙂🚀, math ∑∫√", 9106931141436905942, 32),
    ("numbers 1234567 3.14159 -0.5e10 0x1F", 17285457458125523271, 19),
    ("   leading spaces, trailing   \n\n\n" + " " * 40 + "x" + "\n" * 20, 7154352994362829814, 11),
    (
        render_chat(
            [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Hi there, how are you?"},
            ]
        ),
        14946144718399061725,
        36,
    ),
]

WHITESPACE = " \t\n\r\x0b\x0c\u00a0\u2003\u3000"


def digest(ids: list[int]) -> int:
    return xxhash.xxh64_intdigest(array("Q", ids).tobytes())


def check_pinned(tok: Tokenizer) -> None:
    for text, expected, n in PINNED:
        ids = tok.encode(text)
        assert (digest(ids), len(ids)) == (expected, n), text


def test_ids_of_a_fixed_corpus_are_those_of_the_unbounded_tokenizer():
    tok = Tokenizer()
    assert tok.encode("hello world 42!") == [17876, 9177, 31319, 28544, 29089, 30180]
    check_pinned(tok)
    check_pinned(tok)  # warm: from the cache


def test_random_whitespace_does_not_grow_memory():
    """The reproduction: long random whitespace runs (one piece each) were all kept."""
    rng = random.Random(9)
    tok = Tokenizer()
    tok.encode("warm up " * 100)
    run = "".join(rng.choices(WHITESPACE, k=256 * 1024))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):  # 40 distinct 256 KiB runs: rotations of one random run
            text = run[i:] + run[:i]
            assert len(tok.encode(text)) == 1
            del text
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2 * 1024 * 1024, f"tokenizer kept {kept / 2**20:.1f} MiB"
    check_pinned(tok)


def test_many_distinct_pieces_stay_under_the_cache_bound():
    rng = random.Random(3)
    tok = Tokenizer(max_cached_pieces=500)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for _ in range(200):  # ~200 distinct 4-letter pieces per text: many rotations
        words = ("".join(rng.choices(letters, k=4)) for _ in range(200))
        tok.encode(" ".join(words) + " " * rng.randrange(1, 5000))
        assert tok.num_cached_pieces <= 2 * (500 + len(OUTPUT_WORDS))
    check_pinned(tok)
    assert tok.decode(tok.word_ids()) == "".join(" " + w for w in OUTPUT_WORDS)


def word(i: int) -> str:
    """The i-th four-letter word (26**4 of them): one piece each, with its space."""
    return " " + "".join(chr(97 + i // 26**k % 26) for k in range(4))


def test_default_bound_holds_under_a_flood_of_distinct_pieces():
    tok = Tokenizer()
    bound = 2 * (tok.max_cached_pieces + len(OUTPUT_WORDS))
    for start in range(0, 3 * tok.max_cached_pieces, 4096):
        assert len(tok.encode("".join(word(i) for i in range(start, start + 4096)))) == 4096
        assert tok.num_cached_pieces <= bound
    assert tok.num_cached_pieces > tok.max_cached_pieces  # it did fill up


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=80), max_size=30), st.text(max_size=300))
def test_a_churned_cache_gives_the_ids_of_a_fresh_tokenizer(seen, text):
    churned = Tokenizer(max_cached_pieces=8)  # rotates every few pieces
    for t in seen:
        churned.encode(t)
    assert churned.encode(text) == Tokenizer().encode(text)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([*OUTPUT_WORDS, ",", ".", "\n", " 42", "  "]), max_size=60),
    st.integers(0, 2000),
)
def test_text_round_trips_after_churn_whenever_it_did_unbounded(words, seen):
    """Ids collide in a 32k vocabulary and the first piece cached keeps the id for decode:
    with the same history, the bounded cache round-trips whatever the unbounded one did."""
    history = " ".join(f"w{i}" for i in range(seen))
    bounded = Tokenizer(max_cached_pieces=64)  # rotated many times by the history
    unbounded = Tokenizer(max_cached_pieces=10**9)  # as before this change
    bounded.encode(history)
    unbounded.encode(history)
    text = "".join(w if not w.isalpha() else " " + w for w in words)
    assert bounded.encode(text) == unbounded.encode(text)
    if unbounded.decode(unbounded.encode(text)) == text:
        assert bounded.decode(bounded.encode(text)) == text


def test_text_with_fewer_distinct_pieces_than_the_bound_round_trips():
    tok = Tokenizer()
    for text, _, _ in PINNED[:3] + PINNED[4:]:  # PINNED[3]: its pieces collide in 32k ids
        assert tok.decode(tok.encode(text)) == text
