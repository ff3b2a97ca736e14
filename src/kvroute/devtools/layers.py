"""The import graph between kvroute's packages, checked against the layer order.

    python -m kvroute.devtools.layers [-v] [SRC]

prints each package with the packages it imports, bottom layer first, and ends with
"no edge goes up, no cycle", or lists each import that breaks the order and each cycle
between modules and exits 1. ``-v`` names the importing modules behind every edge.
tests/test_layers.py runs the same check.

The layers, bottom first (docs/internals.md, "Layers"):

- ``common``: what every layer speaks (block hashing, tokenizer, chat template, KV
  event wire types); pure, imports no other package.
- ``core`` (routing) and ``engine`` (the engine model): pure, independent of each other.
- ``router`` (the live proxy) and ``sim`` (the HTTP simulator): the edges around the
  pure code; independent of each other.
- ``bench``: workloads, load generator, comparisons; drives routers and simulators.
- ``des``: the discrete-event simulator (core + engine in virtual time, bench workloads).
- ``cli`` (the ``kvroute`` command) and ``devtools``: on top.

A package may import packages of lower layers only; packages of one layer never import
each other. Inside a package any import is allowed, but no two modules may import each
other, directly or through others: the module graph has no cycle. Every import counts,
including those inside functions and under ``TYPE_CHECKING``, and
``importlib.import_module`` with a literal name; a module name computed at run time (as
``kvroute.cli`` does for its subcommands) is not seen.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = "kvroute"
# bottom first; ``kvroute`` is the root package's own __init__ (only a version string)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvroute", "common"),
    ("core", "engine"),
    ("router", "sim"),
    ("bench",),
    ("des",),
    ("cli", "devtools"),
)
LAYER_OF: dict[str, int] = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a kvroute module by another."""

    importer: str  # dotted module name, e.g. kvroute.core.fleet
    imported: str  # dotted module name it resolves to (a package's __init__: the package)
    path: Path  # file of the importer
    lineno: int


def package_of(module: str) -> str:
    """``core`` for kvroute.core.fleet, ``cli`` for kvroute.cli, ``kvroute`` for kvroute."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def may_import(importer: str, imported: str) -> bool:
    """Whether package ``importer`` may import package ``imported`` (both have a layer)."""
    return importer == imported or LAYER_OF[imported] < LAYER_OF[importer]


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``src`` (the kvroute folder)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = [ROOT, *path.relative_to(src).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def scan(src: Path) -> list[Import]:
    """Every import between modules under ``src``, in file order (one per statement and
    imported module: ``from m import a, b`` is one)."""
    modules = module_files(src)
    found: dict[Import, None] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, module, is_package, modules):
                if target != module:
                    found[Import(module, target, path, node.lineno)] = None
    return list(found)


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join([*here, base] if base else here)
        # ``from pkg import name``: the submodule pkg.name when there is one, else pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    elif (
        isinstance(node, ast.Call)
        and _called_name(node.func) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        names = [node.args[0].value]
    return [m for m in (_existing(name, modules) for name in names) if m is not None]


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _existing(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a kvroute module (None: not kvroute)."""
    if name != ROOT and not name.startswith(ROOT + "."):
        return None
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def package_graph(imports: Iterable[Import]) -> dict[str, dict[str, list[Import]]]:
    """importer package -> imported package -> the imports behind that edge."""
    graph: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports:
        a, b = package_of(imp.importer), package_of(imp.imported)
        graph[a]  # a package that imports nothing else still appears
        if a != b:
            graph[a][b].append(imp)
    return graph


def module_cycles(imports: Iterable[Import]) -> list[list[str]]:
    """The cycles of the module graph: each strongly connected component of more than one
    module, as a sorted list of names (Tarjan's algorithm, iterative)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        edges[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def problems(imports: Sequence[Import], src: Path | None = None) -> list[str]:
    """Everything that breaks the layer order, one line each; empty when all is well."""
    found = []
    packages = {package_of(m) for m in module_files(src)} if src is not None else set()
    for imp in imports:
        packages |= {package_of(imp.importer), package_of(imp.imported)}
    for pkg in sorted(packages - set(LAYER_OF)):
        found.append(f"package {pkg!r} has no layer: add it to LAYERS in {__name__}")
    for a, targets in sorted(package_graph(imports).items()):
        for b, behind in sorted(targets.items()):
            if a in LAYER_OF and b in LAYER_OF and not may_import(a, b):
                way = "up" if LAYER_OF[b] > LAYER_OF[a] else "sideways"
                for imp in behind:
                    found.append(
                        f"{a} -> {b} goes {way}: {imp.path}:{imp.lineno}"
                        f" ({imp.importer} imports {imp.imported})"
                    )
    for cycle in module_cycles(imports):
        found.append("cycle between modules: " + ", ".join(cycle))
    return found


def report(imports: Sequence[Import], src: Path | None = None, *, verbose: bool = False) -> str:
    """The graph, bottom layer first, and the verdict."""
    graph = package_graph(imports)
    present = {package_of(m) for m in module_files(src)} if src is not None else set(graph)
    lines = ["kvroute packages, bottom layer first, each with the packages it imports:", ""]
    order = [(i, pkg) for i, layer in enumerate(LAYERS) for pkg in layer if pkg in present]
    order += [(-1, pkg) for pkg in sorted(present - set(LAYER_OF))]
    width = max((len(pkg) for _, pkg in order), default=0)
    shown_layer = None
    for layer, pkg in order:
        label = ("layer ?" if layer < 0 else f"layer {layer}") if layer != shown_layer else ""
        shown_layer = layer
        targets = sorted(graph.get(pkg, {}), key=lambda b: (LAYER_OF.get(b, 99), b))
        lines.append(f"  {label:8} {pkg:{width}}  {', '.join(targets) or '-'}")
        if verbose:
            for b in targets:
                importers = sorted({i.importer.removeprefix(ROOT + ".") for i in graph[pkg][b]})
                lines.append(f"  {'':8} {'':{width}}    {b} <- {', '.join(importers)}")
    found = problems(imports, src)
    num_modules = len(module_files(src)) if src is not None else 0
    lines.append("")
    if found:
        lines += ["NOT LAYERED:", *(f"  {p}" for p in found)]
    else:
        edges = {(i.importer, i.imported) for i in imports}
        lines.append(
            f"no edge goes up, no cycle ({num_modules} modules, {len(edges)} imports between them)"
        )
    return "\n".join(lines)


def default_src() -> Path:
    """The kvroute package this module belongs to."""
    return Path(__file__).resolve().parents[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.devtools.layers",
        description="Print the import graph between kvroute's packages; exit 1 if an "
        "import goes up or sideways in the layer order, or modules import each other.",
    )
    parser.add_argument("src", nargs="?", type=Path, help="the kvroute package folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="name the importers")
    args = parser.parse_args(argv)
    src = args.src or default_src()
    imports = scan(src)
    print(report(imports, src, verbose=args.verbose))
    return 1 if problems(imports, src) else 0


if __name__ == "__main__":
    sys.exit(main())
