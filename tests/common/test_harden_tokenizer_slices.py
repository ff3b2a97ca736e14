"""The built-in tokenizer cuts long texts into slices (so a thread gives the GIL back
between them); the pieces must be exactly those of one pass over the whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common import tokenizer as tok

# the characters the piece pattern tells apart: letters, digits, symbols, whitespace
TEXT = st.text(alphabet=st.sampled_from("ab Z9 0.,-\n\t  é中"), max_size=300)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, slice_chars=st.integers(1, 12))
def test_sliced_pieces_equal_one_pass(text: str, slice_chars: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tok, "_SLICE_CHARS", slice_chars)
        assert tok._pieces(text) == tok._PIECE.findall(text)


def test_a_long_prompt_is_tokenized_in_slices_with_the_same_ids() -> None:
    text = "the quick brown fox, 12345 jumps\n\n over  the lazy dog. " * 5_000  # 285K chars
    one_pass = [tok._piece_id(p) for p in tok._PIECE.findall(text)]
    assert tok.Tokenizer().encode(text) == one_pass


@settings(max_examples=200, deadline=None)
@given(text=TEXT, slice_chars=st.integers(1, 12))
def test_count_equals_the_number_of_ids(text: str, slice_chars: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tok, "_SLICE_CHARS", slice_chars)
        assert tok.Tokenizer().count(text) == len(tok.Tokenizer().encode(text))
