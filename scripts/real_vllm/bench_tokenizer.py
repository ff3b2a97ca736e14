"""Exact-mode router throughput with the tiny model's tokenizer: see
``kvroute.bench.perf.tokenizer`` (``--help``). Needs ``scripts/real_vllm/setup.sh`` once."""

import sys
from pathlib import Path

from kvroute.bench.perf.tokenizer import main

if __name__ == "__main__":
    sys.exit(main(repo=Path(__file__).resolve().parents[2]))
