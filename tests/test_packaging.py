"""The package's floors admit no Python or aiohttp that cannot run it safely (issue 9,
finding 13): the code needs Python 3.11 (asyncio.timeout), and aiohttp releases before
3.14.3 have HTTP-parser advisories (see the comment in pyproject.toml)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def _floor(spec: str) -> tuple[int, ...]:
    match = re.search(r">=\s*([0-9.]+)", spec)
    assert match, f"no lower bound in {spec!r}"
    return tuple(int(part) for part in match.group(1).split("."))


def test_python_floor_is_the_one_the_code_needs() -> None:
    assert _floor(PYPROJECT["project"]["requires-python"]) >= (3, 11)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"


def test_aiohttp_floor_excludes_releases_with_parser_advisories() -> None:
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("aiohttp")]
    assert _floor(spec) >= (3, 14, 3)
