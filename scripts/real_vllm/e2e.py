"""kvroute in front of real vLLM CPU engines: ``kvroute.bench.real_vllm.e2e`` (``--help``).

Run with the main venv (it has kvroute); the engines run from .venv-vllm:

    scripts/real_vllm/setup.sh
    .venv/bin/python scripts/real_vllm/e2e.py                      # 2 engines, 72 requests
    .venv/bin/python scripts/real_vllm/e2e.py --repeat 5 --json out.json
"""

import sys
from pathlib import Path

from kvroute.bench.real_vllm.e2e import main

if __name__ == "__main__":
    sys.exit(main(repo=Path(__file__).resolve().parents[2]))
