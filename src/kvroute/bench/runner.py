"""``run_benchmark``: one workload against one target, measured end to end.

This is the in-process entry point ``kvroute bench`` uses, and the one ``compare`` and
``demo`` call once per router: warm-up, a /metrics snapshot of every backend, the
measured run, a second snapshot, then the result dict (keys: docs/architecture.md, "Result JSON").
"""

from __future__ import annotations

import asyncio
import datetime
import json
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.bench.ceiling import DEFAULT_BLOCK_SIZE, SentSpecs, block_size_of, run_ceiling
from kvroute.bench.fleet import engine_deltas, fleet_results
from kvroute.bench.load import LoadConfig
from kvroute.bench.loadgen import LoadGenerator, ProgressFn
from kvroute.bench.metrics import (
    EngineCounters,
    RequestRecord,
    backend_key,
    parse_engine_counters,
    summarize,
)
from kvroute.bench.workloads.base import Workload


@dataclass(slots=True)
class BenchResult:
    """The outcome of one run."""

    result: dict[str, Any]  # result.json: vLLM bench-serve keys + kvroute keys
    records: list[RequestRecord] = field(default_factory=list)  # warm-up and measured

    def __getitem__(self, key: str) -> Any:
        return self.result[key]


def metrics_url(url: str) -> str:
    """A backend URL or its /metrics URL -> the /metrics URL."""
    return backend_key(url) + "/metrics"


async def scrape_counters(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0
) -> EngineCounters | None:
    """The engine counters of one backend; None when it cannot be read."""
    try:
        async with session.get(
            metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            return parse_engine_counters(await resp.text())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def scrape_all(
    session: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, EngineCounters | None]:
    values = await asyncio.gather(*(scrape_counters(session, u) for u in urls))
    return {backend_key(u): v for u, v in zip(urls, values, strict=True)}


async def scrape_block_size(
    session: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float = 10.0
) -> int | None:
    """The engines' KV block size (``vllm:cache_config_info``) from the first that says."""
    for url in urls:
        try:
            async with session.get(
                metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status == 200 and (size := block_size_of(await resp.text())):
                    return size
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            continue
    return None


async def discover_model(session: aiohttp.ClientSession, target_url: str) -> str | None:
    """First model id of the target's /v1/models, or None (then no "model" is sent)."""
    try:
        async with session.get(
            target_url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json()).get("data") or []
            return str(data[0]["id"]) if data else None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None


class TargetError(ValueError):
    """The target cannot take the benchmark (not a URL, not answering, unknown model)."""


CHECK_TIMEOUT_S = 10.0  # the pre-flight requests of ``check_target``


def check_target_url(target_url: str) -> None:
    """TargetError unless ``target_url`` is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(target_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(
            f"--target {target_url!r} is not an http(s) URL; give the base URL of the "
            "router or engine, e.g. http://127.0.0.1:8000"
        )


async def check_target(
    session: aiohttp.ClientSession, target_url: str, model: str | None = None
) -> None:
    """Before any load: the target answers GET /v1/models (or, when it has none, GET
    /health) with 200 and, when its list is read and ``model`` is given, serves ``model``.
    TargetError naming the target and the cause otherwise."""
    check_target_url(target_url)
    base = target_url.rstrip("/")
    hint = (
        "; drop the /v1 from --target (bench adds /v1/... itself)" if base.endswith("/v1") else ""
    )
    timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)
    try:
        async with session.get(base + "/v1/models", timeout=timeout) as resp:
            status, body = resp.status, await resp.read()
        if status == 404 and not hint:  # an endpoint without the list: is it up at all?
            async with session.get(base + "/health", timeout=timeout) as resp:
                if resp.status == 200:
                    return
    except TimeoutError:
        raise TargetError(
            f"--target {target_url}: no answer in {CHECK_TIMEOUT_S:g} s{hint}"
        ) from None
    except aiohttp.ClientError as exc:
        raise TargetError(
            f"--target {target_url}: cannot connect ({type(exc).__name__}: {exc}); "
            "is the router or engine running there?"
        ) from None
    if status != 200:
        text = body[:200].decode(errors="replace").strip()
        raise TargetError(
            f"--target {target_url}: GET {base}/v1/models answered {status}: {text}{hint}"
        )
    served = _model_ids(body)
    if model is not None and served is not None and model not in served:
        raise TargetError(
            f"--model {model!r} is not served by {target_url}; it serves: "
            + (", ".join(served) or "no model")
        )


async def check_backend_metrics(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Before any load: each ``--backend-metrics`` URL gives an engine's prefix-cache
    counters (else the run would end with "hit rate n/a"); TargetError names the first
    that does not."""
    values = await asyncio.gather(*(scrape_counters(session, u, CHECK_TIMEOUT_S) for u in urls))
    for url, counters in zip(urls, values, strict=True):
        if counters is None:
            raise TargetError(
                f"--backend-metrics {url}: {metrics_url(url)} gives no engine prefix-cache "
                "counters (unreachable, or not an engine: give each engine's own address, "
                "not the router's)"
            )


def _model_ids(body: bytes) -> list[str] | None:
    """The ids of an OpenAI model list; None when ``body`` is not one."""
    try:
        data = json.loads(body).get("data")
        return [str(card["id"]) for card in data]
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


async def run_benchmark(
    target_url: str,
    workload: Workload,
    load_config: LoadConfig,
    backend_metrics_urls: Sequence[str] = (),
    *,
    router: str | None = None,
    progress: ProgressFn | None = None,
    session: aiohttp.ClientSession | None = None,
    target_is_backend: bool = True,
    extra_config: dict[str, Any] | None = None,
    block_size: int | None = None,
) -> BenchResult:
    """Run ``workload`` against ``target_url`` under ``load_config`` and measure it.

    ``backend_metrics_urls``: engines whose /metrics give the true prefix-cache hit
    rate and the per-backend prefill load. ``router``: label stored in the result.
    ``target_is_backend``: attribute requests without an ``x-kvroute-backend`` header
    to the target itself (right for a single engine; pass False for a router that does
    not say where it sent a request). ``extra_config`` is merged into ``config``.
    ``block_size``: the engines' KV block size for the infinite-cache ceiling
    (``bench.ceiling``); None: read from the engines' /metrics, else vLLM's default 16.
    """
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        model = load_config.model or await discover_model(session, target_url)
        sent = SentSpecs(workload)  # the ceiling needs the prompts the records stand for
        gen = LoadGenerator(
            session,
            target_url,
            sent,
            load_config,
            model=model,
            default_backend=backend_key(target_url) if target_is_backend else None,
            progress=progress,
        )
        await gen.warmup()
        before = await scrape_all(session, backend_metrics_urls)
        duration_s = await gen.run()
        after = await scrape_all(session, backend_metrics_urls)
        if block_size is None:
            engines = list(backend_metrics_urls) or ([target_url] if target_is_backend else [])
            block_size = await scrape_block_size(session, engines) or DEFAULT_BLOCK_SIZE
    finally:
        if own:
            await session.close()
    result = summarize(gen.records, duration_s)
    result.update(fleet_results(gen.records, engine_deltas(before, after)))
    described = workload.describe()
    # Over the requests this run sent; a trace's own ceiling stays under "workload".
    result["cache_ceiling_hit_rate"] = run_ceiling(gen.records, sent.specs, block_size)
    result["cache_ceiling_block_size"] = block_size
    result["stopped_early"] = gen.stopped
    result.update(
        workload=described,
        router=router,
        config={
            "target": target_url,
            "model": model,
            "backend_metrics": list(backend_metrics_urls),
            "unreadable_metrics": [u for u, v in after.items() if v is None],
            "load": load_config.to_json(),
            **(extra_config or {}),
        },
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    return BenchResult(result, gen.records)
