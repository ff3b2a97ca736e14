"""The packages keep the layer order of docs/internals.md: no import goes up or sideways,
no two modules import each other. ``python -m kvroute.devtools.layers`` prints the same
check as a graph."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvroute.devtools.layers import (
    LAYERS,
    default_src,
    main,
    may_import,
    module_cycles,
    problems,
    scan,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "kvroute"


def test_the_source_tree_keeps_the_layers() -> None:
    imports = scan(SRC)
    assert imports, "the scan found no imports at all"
    assert problems(imports, SRC) == []


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    packages |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert packages <= {pkg for layer in LAYERS for pkg in layer}


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("core", "common", True),
        ("engine", "common", True),
        ("core", "engine", False),  # the pure halves are independent
        ("engine", "core", False),
        ("common", "core", False),
        ("router", "core", True),
        ("router", "sim", False),
        ("sim", "engine", True),
        ("bench", "sim", True),
        ("bench", "router", True),
        ("sim", "bench", False),
        ("des", "bench", True),
        ("bench", "des", False),
        ("cli", "bench", True),
        ("core", "cli", False),
    ],
)
def test_the_allowed_directions(importer: str, imported: str, allowed: bool) -> None:
    assert may_import(importer, imported) is allowed


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake kvroute package folder: ``{"core/x.py": source}`` (inits added)."""
    src = tmp_path / "kvroute"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == src.parent:
                break
            (parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return src


def test_an_edge_up_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"core/a.py": "import math\nfrom kvroute.router import app\n",
                           "router/app.py": ""})  # fmt: skip
    (found,) = problems(scan(src), src)
    assert found.startswith("core -> router goes up: ")
    assert found.endswith("core/a.py:2 (kvroute.core.a imports kvroute.router.app)")


def test_a_sideways_edge_and_imports_inside_functions_count(tmp_path: Path) -> None:
    src = _tree(tmp_path, {
        "engine/e.py": "def f():\n    from kvroute.core.k import K\n",
        "core/k.py": "K = 1\n",
    })  # fmt: skip
    (found,) = problems(scan(src), src)
    assert found.startswith("engine -> core goes sideways: ")


def test_relative_and_lazy_imports_are_resolved(tmp_path: Path) -> None:
    src = _tree(tmp_path, {
        "common/a.py": "from ..sim import s\n",
        "common/b.py": "import importlib\nm = importlib.import_module('kvroute.bench.x')\n",
        "sim/s.py": "",
        "bench/x.py": "",
    })  # fmt: skip
    found = problems(scan(src), src)
    assert [f.split(":")[0] for f in found] == ["common -> bench goes up", "common -> sim goes up"]


def test_a_cycle_inside_a_package_is_reported(tmp_path: Path) -> None:
    src = _tree(tmp_path, {
        "sim/api.py": "from kvroute.sim.server import S\n",
        "sim/server.py": "def f():\n    from kvroute.sim import api\n",
        "sim/ok.py": "from kvroute.sim.server import S\n",
    })  # fmt: skip
    imports = scan(src)
    assert module_cycles(imports) == [["kvroute.sim.api", "kvroute.sim.server"]]
    assert problems(imports, src) == ["cycle between modules: kvroute.sim.api, kvroute.sim.server"]


def test_a_package_without_a_layer_is_reported(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"extras/x.py": "", "core/a.py": ""})
    assert problems(scan(src), src) == [
        "package 'extras' has no layer: add it to LAYERS in kvroute.devtools.layers"
    ]


def test_the_command_prints_the_graph_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert default_src() == SRC
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "  layer 1  core" in out
    assert out.rstrip().splitlines()[-1].startswith("no edge goes up, no cycle (")


def test_the_command_fails_on_a_broken_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tree(tmp_path, {"core/a.py": "import kvroute.engine.e\n", "engine/e.py": ""})
    assert main([str(src)]) == 1
    out = capsys.readouterr().out
    assert "NOT LAYERED:" in out
    assert "core -> engine goes sideways" in out


def test_the_module_runs_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.devtools.layers"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no edge goes up, no cycle" in done.stdout
