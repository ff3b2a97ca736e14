"""Flag checks shared by the bench-side commands (``bench``, ``soak``, ``chaos``).

The argparse types turn a value out of range into argparse's own one-line error, which
names the flag (``kvroute soak: error: argument --duration: must be a number > 0, got
'0'``, exit 2), instead of a ValueError from a config class deep in the run.
``check_out_dir`` and ``make_out_dir`` check an output folder before a run rather than
after it.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from kvroute.sim.profiles import get_profile


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def engine_profile(text: str) -> str:
    """A built-in engine profile name or a profile YAML file (``sim.profiles``)."""
    try:
        get_profile(text)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """ValueError naming ``flag`` unless ``path`` is a writable folder or could be made
    one (its nearest existing ancestor is a writable folder); creates nothing."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out}: is a file, not a folder; give a folder to write into")
    existing = next((p for p in (out, *out.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ValueError(f"{flag} {out}: cannot create it ({existing} is not a folder)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: cannot create it ({existing} is not writable)")
    return out


def make_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """Create the output folder ``path`` (and its parents) now, before a run writes into
    it; ValueError naming ``flag`` when it is a file or cannot be created."""
    out = check_out_dir(path, flag)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {out}: cannot create it ({exc.strerror or exc})") from None
    return out
