"""The parts a discrete-event simulator reuses do no I/O, read no clock, use no global random."""

from __future__ import annotations

import ast
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "src" / "kvroute" / "bench"
PURE = ["spec.py", "arrivals.py", "metrics.py", "fleet.py", "load.py", "sse.py", "decisions.py"]
PURE += [str(p.relative_to(BENCH)) for p in sorted((BENCH / "workloads").glob("*.py"))]
FORBIDDEN = {"asyncio", "aiohttp", "socket", "time", "threading", "zmq"}


@pytest.mark.parametrize("name", PURE)
def test_module_is_pure(name):
    tree = ast.parse((BENCH / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not FORBIDDEN & {a.name.split(".")[0] for a in node.names}, name
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in FORBIDDEN, name
            if node.module == "random":
                assert all(a.name == "Random" for a in node.names), name
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "random":
            assert node.attr == "Random", f"{name}: global random.{node.attr}"
