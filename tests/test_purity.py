"""The core and the engine are pure: no I/O, no clock, no global random (style.md §7.1)."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "kvroute"
FORBIDDEN_MODULES = {"asyncio", "aiohttp", "socket", "time", "zmq", "threading"}


def _pure_files():
    for package in ("core", "engine"):
        yield from sorted((SRC / package).rglob("*.py"))


@pytest.mark.parametrize("path", list(_pure_files()), ids=lambda p: str(p.relative_to(SRC)))
def test_pure_packages_import_no_io_clock_or_global_random(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
            if node.module == "random":
                assert all(a.name == "Random" for a in node.names), f"{path}: global random"
        else:
            continue
        bad = FORBIDDEN_MODULES.intersection(names)
        assert not bad, f"{path} imports {bad}"
