"""Router throughput in exact mode with a real model's tokenizer (no engine needed).

Exact mode tokenizes every prompt with the model's ``tokenizer.json`` and chat template.
For a 4,400-token chat that is milliseconds of Rust per request; the proxy runs it in a
thread (``encode_batch`` releases the GIL) so the worker keeps serving meanwhile. This
puts ``kvroute serve --mode exact --tokenizer m=DIR`` in front of canned backends (no
engine) and drives it with wrk and ranvier-stress chat bodies.

    scripts/real_vllm/setup.sh        # once: .venv-vllm with the tiny model's tokenizer
    .venv/bin/python scripts/real_vllm/bench_tokenizer.py [--model-dir DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from kvroute.bench.perf.clients import measure_throughput, request_bodies
from kvroute.bench.perf.workers import minimal_fleet, router


def main(argv: list[str] | None = None, *, repo: Path | None = None) -> int:
    """``repo``: where ``.venv-vllm`` lives (default: the current directory)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_dir = (repo or Path.cwd()) / ".venv-vllm" / "models" / "tiny"
    ap.add_argument("--model-dir", type=Path, default=default_dir)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if not (args.model_dir / "tokenizer.json").is_file():
        ap.error(f"no tokenizer.json in {args.model_dir}: run scripts/real_vllm/setup.sh")
    if shutil.which("wrk") is None:
        ap.error("needs wrk (apt install wrk)")
    print(f"exact mode, tokenizer {args.model_dir}, {args.backends} canned backends, wrk "
          f"-c{args.connections}, ranvier-stress chats, {args.duration:g} s per round")  # fmt: skip
    flags = ["--mode", "exact", "--tokenizer", f"m={args.model_dir}"]
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-tokenizer-") as folder,
        minimal_fleet(args.backends, Path(folder)) as urls,
    ):
        bodies = request_bodies("ranvier-stress", "m")
        for k in range(args.rounds):
            with router(urls, 1, "prefix", Path(folder), extra=flags) as (url, pid):
                rps, p50, cpu_us = measure_throughput(
                    url, pid, bodies, client="wrk", connections=args.connections,
                    duration_s=args.duration,
                )  # fmt: skip
            print(f"round {k + 1}: {rps:.0f} req/s, p50 {p50:.1f} ms, "
                  f"router CPU {cpu_us:.0f} us/request", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
