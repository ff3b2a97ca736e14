"""Check a running ``kvroute sim`` against the must-show figures and print them.

Start the simulator, then run this against two of its backends:

    kvroute sim --backends 2 --profile codellama-13b-a100 &
    python -m kvroute.bench.sim_check --urls http://127.0.0.1:8001 http://127.0.0.1:8002

(``scripts/sim_mustshow.py`` runs the same.)

It measures from the client: (1) the TTFT of a fresh ~4,000-token prompt (a miss);
(2) the same prompt again on the same backend (a hit: cached_tokens and the growth of
``vllm:prefix_cache_hits_total``); (3) the same prompt on the other backend (a miss);
(4) N concurrent different ~4,000-token prompts to one backend, sampling its waiting
queue, running count and KV usage while they run. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import aiohttp

from kvroute.common.tokenizer import OUTPUT_WORDS, default_tokenizer
from kvroute.common.vllm_metrics import EngineMetrics, parse_vllm_metrics


def make_prompt(tag: str, num_tokens: int, rng: random.Random) -> str:
    """About ``num_tokens`` tokens (each word is one token), distinct from the first block."""
    return f"{tag}:" + "".join(" " + rng.choice(OUTPUT_WORDS) for _ in range(num_tokens))


async def metrics(session: aiohttp.ClientSession, base: str) -> EngineMetrics:
    async with session.get(base + "/metrics") as resp:
        return parse_vllm_metrics(await resp.text())


async def timed(
    session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """Stream one completion; TTFT and end-to-end in seconds, and the usage block."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": resp.status, "body": await resp.text()}
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "usage": usage}


def _hits(m: EngineMetrics) -> float:
    return m.prefix_cache_hits or 0.0


def cached(result: dict[str, Any]) -> int:
    return ((result.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def repeat_checks(session: aiohttp.ClientSession, a: str, b: str, n_tokens: int) -> None:
    prompt = make_prompt(f"mustshow-{time.time_ns()}", n_tokens, random.Random(1))
    n_prompt = len(default_tokenizer().encode(prompt))
    print(f"prompt: {n_prompt} tokens")
    m0 = await metrics(session, a)
    miss = await timed(session, a, prompt, 16)
    m1 = await metrics(session, a)
    hit = await timed(session, a, prompt, 16)
    m2 = await metrics(session, a)
    print(f"1. miss on A:        TTFT {miss['ttft_s']:.3f} s  cached_tokens {cached(miss)}  "
          f"hits_total +{_hits(m1) - _hits(m0):.0f}")  # fmt: skip
    print(f"2. repeat on A:      TTFT {hit['ttft_s'] * 1000:.1f} ms  cached_tokens {cached(hit)}"
          f"  hits_total +{_hits(m2) - _hits(m1):.0f}")  # fmt: skip
    mb0 = await metrics(session, b)
    other = await timed(session, b, prompt, 16)
    mb1 = await metrics(session, b)
    print(f"3. same on B:        TTFT {other['ttft_s']:.3f} s  cached_tokens {cached(other)}  "
          f"B hits_total +{_hits(mb1) - _hits(mb0):.0f}")  # fmt: skip


async def sample(
    session: aiohttp.ClientSession, base: str, stop: asyncio.Event
) -> list[EngineMetrics]:
    samples = []
    while not stop.is_set():
        samples.append(await metrics(session, base))
        await asyncio.sleep(0.1)
    return samples


async def burst(session: aiohttp.ClientSession, a: str, n_tokens: int, n: int, out: int) -> None:
    rng = random.Random(2)
    prompts = [make_prompt(f"burst-{time.time_ns()}-{i}", n_tokens, rng) for i in range(n)]
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(session, a, stop))
    start = time.perf_counter()
    results = await asyncio.gather(*(timed(session, a, p, out) for p in prompts))
    wall = time.perf_counter() - start
    stop.set()
    samples = await sampler
    ok = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    ttfts = sorted(r["ttft_s"] for r in ok)
    print(f"4. {n} concurrent different {n_tokens}-token prompts to A ({out} output tokens):")
    print(f"   completed {len(ok)}/{n}, failed {n - len(ok)}, wall {wall:.1f} s")
    if ttfts:
        q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts
        print(f"   TTFT min {ttfts[0]:.2f} s  median {statistics.median(ttfts):.2f} s  "
              f"p90 {q[-1]:.2f} s  max {ttfts[-1]:.2f} s")  # fmt: skip
    for name, field in (("vllm:num_requests_waiting", "num_waiting"),
                        ("vllm:num_requests_running", "num_running"),
                        ("vllm:kv_cache_usage_perc", "kv_cache_usage")):  # fmt: skip
        values = [getattr(s, field) or 0.0 for s in samples]
        print(f"   {name:28s} max {max(values):.2f}  (sampled every 0.1 s, {len(values)} samples)")
    if samples:
        preempted = samples[-1].num_preemptions or 0
        print(f"   vllm:num_preemptions_total    {preempted:.0f}")


async def run(args: argparse.Namespace) -> None:
    a, b = args.urls
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await repeat_checks(session, a, b, args.prompt_tokens)
        await burst(session, a, args.prompt_tokens, args.concurrency, args.output_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--urls", nargs=2, default=["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
