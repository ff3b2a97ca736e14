"""Steps per second of Engine.step (prints numbers; not a test, no assertions on time).

Run: .venv/bin/python -m tests.engine.bench_engine
"""

from __future__ import annotations

import time

from kvroute.engine import Engine
from kvroute.sim.profiles import get_profile


def busy_decode(num_seqs: int, num_steps: int = 500) -> float:
    """Steps/s with ``num_seqs`` requests decoding together (500-token prompts)."""
    engine = Engine(get_profile("llama-3.1-8b-a100"))
    for i in range(num_seqs):
        engine.add_request(f"r{i}", list(range(i * 1000, i * 1000 + 500)), 2000)
    while engine.stats.num_running < num_seqs or engine.step().num_prefill_tokens:
        engine.step()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    return num_steps / (time.perf_counter() - start)


def main() -> None:
    for num_seqs in (1, 32, 256):
        print(f"decode batch of {num_seqs:3d}: {busy_decode(num_seqs):8.0f} steps/s")
    profile = get_profile("codellama-13b-a100")
    engine = Engine(profile)
    engine.add_request("miss", list(range(4000)), 1)
    miss_s = engine.step().duration_s
    engine.add_request("hit", list(range(4000)), 1)
    hit_s = engine.step().duration_s
    a_api_s = profile.a_api_ms / 1000
    print(
        f"codellama-13b-a100 4k-token TTFT: miss {miss_s + a_api_s:.3f} s (engine {miss_s:.3f}),"
        f" hit {hit_s + a_api_s:.3f} s (engine {hit_s:.4f})"
    )


if __name__ == "__main__":
    main()
