"""Numbers that YAML read as text: the hint that says how to write them.

PyYAML follows YAML 1.1, which reads ``3e3``, ``1e-6`` and ``1_000.5`` as strings (an
exponent needs a dot before it), and a quoted number is a string too. A config or profile
that expects a number says so with this hint instead of a bare "got '1e-6'".
"""

from __future__ import annotations

import math


def number_as_text_hint(value: object) -> str:
    """`` (text, not a number: write it 1.0e-06, unquoted)`` when ``value`` is a string
    that reads as a finite number, else ""."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    shown = repr(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    mantissa, e, exponent = shown.partition("e")
    if e and "." not in mantissa:  # 1e-06 is text to YAML 1.1 too: 1.0e-06 is a number
        shown = f"{mantissa}.0e{exponent}"
    return f" (text, not a number: write it {shown}, unquoted)"
