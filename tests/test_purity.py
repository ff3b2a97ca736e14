"""The bottom package, the core and the engine are pure: no I/O, no clock, no global
random (docs/architecture.md, convention 1). Callers pass ``now`` and a seeded
``random.Random``; files and YAML are read at the edges (router/, sim/, bench/)."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "kvroute"
PURE_PACKAGES = ("common", "core", "engine")
FORBIDDEN_MODULES = {
    # event loops, sockets, threads: the edges run these
    "asyncio",
    "aiohttp",
    "socket",
    "zmq",
    "threading",
    # the clock: time is an argument
    "time",
    # files, the environment, processes: read at the edges and passed in as values
    "os",
    "pathlib",
    "shutil",
    "subprocess",
    "yaml",
}


def _pure_files():
    for package in PURE_PACKAGES:
        yield from sorted((SRC / package).rglob("*.py"))


def impurities(tree: ast.AST) -> list[str]:
    """What in ``tree`` breaks purity: a forbidden import, or the global random (any use
    of the ``random`` module but ``random.Random``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"line {node.lineno}: import {alias.name}")
                if alias.name == "random" and alias.asname not in (None, "random"):
                    found.append(f"line {node.lineno}: random imported as {alias.asname}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            if node.module == "random":
                found += [
                    f"line {node.lineno}: from random import {a.name} (global random)"
                    for a in node.names
                    if a.name != "Random"
                ]
        elif (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) == "random"
            and node.attr != "Random"
        ):
            found.append(f"line {node.lineno}: random.{node.attr} (global random)")
    return found


@pytest.mark.parametrize("path", list(_pure_files()), ids=lambda p: str(p.relative_to(SRC)))
def test_pure_packages_import_no_io_clock_or_global_random(path):
    assert impurities(ast.parse(path.read_text())) == [], path


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", ["line 1: import os"]),
        ("import os.path", ["line 1: import os.path"]),
        ("from pathlib import Path", ["line 1: from pathlib import ..."]),
        ("import yaml", ["line 1: import yaml"]),
        ("import time", ["line 1: import time"]),
        ("import random\nx = random.random()", ["line 2: random.random (global random)"]),
        ("import random\nrandom.seed(1)", ["line 2: random.seed (global random)"]),
        ("from random import choice", ["line 1: from random import choice (global random)"]),
        ("import random as r", ["line 1: random imported as r"]),
        ("import random\nrng = random.Random(7)", []),
        ("from random import Random", []),
        ("import math, dataclasses", []),
    ],
)
def test_the_check_catches_io_and_global_random(source, expected):
    assert impurities(ast.parse(source)) == expected
