"""The hint for numbers YAML read as text must name a spelling YAML reads as the number."""

from __future__ import annotations

import math

import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvroute.common.yaml_text import number_as_text_hint


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_the_spelling_given_reads_back_as_the_number(number: float) -> None:
    text = repr(number)
    hint = number_as_text_hint(text)
    spelled = hint.removeprefix(" (text, not a number: write it ").removesuffix(", unquoted)")
    assert hint and spelled != hint
    read = yaml.safe_load(f"x: {spelled}")["x"]
    assert isinstance(read, int | float) and math.isclose(read, number, rel_tol=1e-12)


def test_text_that_is_no_number_gets_no_hint() -> None:
    assert number_as_text_hint("abc") == number_as_text_hint(3.0) == ""
    assert number_as_text_hint("inf") == ""
    assert "1.0e-06" in number_as_text_hint("1e-6")  # 1e-06 would be text again
