"""The ``kvroute`` command: one subcommand per product feature.

Each feature owns a module exposing ``add_parser(subparsers)``, which registers its
subcommand and sets ``func`` (called with the parsed arguments, returns an exit code).
Modules are imported lazily so ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that defines it
COMMANDS: dict[str, str] = {
    "demo": "kvroute.bench.demo_cli",
    "serve": "kvroute.router.cli",
    "sim": "kvroute.sim.cli",
    "bench": "kvroute.bench.cli",
    "compare": "kvroute.bench.compare_cli",
    "simulate": "kvroute.des.cli",
    "soak": "kvroute.bench.soak_cli",
    "chaos": "kvroute.bench.chaos_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-cache-aware load balancer for LLM inference fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # feature not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
