"""Metrics scraper: reads each backend's vLLM gauges and feeds Fleet.update_engine_stats.

Runs in the background, never on the request path. The page is first cut down to the
few families we read (a vLLM page has hundreds of lines of histograms), then parsed with
``prometheus_client.parser``. Series of one family (per engine, per model) are summed.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.backends import BackendRuntime, EngineSample
from kvroute.router.state import RouterState

log = logging.getLogger("kvroute.router.scraper")

# the samples read; kv usage falls back to the vLLM v0 name
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
CACHE_INFO = "vllm:cache_config_info"
_PREFIXES = (RUNNING, WAITING, *KV_USAGE, HITS[:-6], QUERIES[:-6], CACHE_INFO)


def _wanted(line: str) -> bool:
    if line.startswith(("# HELP ", "# TYPE ")):
        line = line[7:]
    return line.startswith(_PREFIXES)


def parse_engine_metrics(text: str) -> EngineSample:
    """The EngineSample of one /metrics page (fields the page lacks are None)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    block_size = num_gpu_blocks = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            if sample.name == CACHE_INFO:
                block_size = _int_label(sample.labels, "block_size") or block_size
                num_gpu_blocks = _int_label(sample.labels, "num_gpu_blocks") or num_gpu_blocks
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    kv = sums.get(KV_USAGE[0], sums.get(KV_USAGE[1]))
    return EngineSample(
        num_running=_opt_int(sums.get(RUNNING)),
        num_waiting=_opt_int(sums.get(WAITING)),
        kv_cache_usage=kv,
        prefix_cache_hits=sums.get(HITS),
        prefix_cache_queries=sums.get(QUERIES),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
    )


def _opt_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


async def scrape(state: RouterState, rt: BackendRuntime) -> None:
    """Scrape one backend; a failure only logs at debug (scraping is best effort)."""
    assert state.session is not None, "scrape runs after startup created the session"
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s)
    headers = {"Authorization": rt.auth_header} if rt.auth_header else {}
    try:
        async with state.session.get(rt.url + "/metrics", timeout=timeout, headers=headers) as r:
            if r.status != 200:
                return
            text = await r.text()
    except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError) as exc:
        log.debug("scrape of %s failed: %s", rt.url, exc)
        return
    try:
        sample = parse_engine_metrics(text)
    except ValueError as exc:
        log.debug("metrics of %s unreadable: %s", rt.url, exc)
        return
    if state.backends.get(rt.url) is not rt:
        return  # removed while we waited
    apply_sample(state, rt, sample)


def apply_sample(state: RouterState, rt: BackendRuntime, sample: EngineSample) -> None:
    rt.engine = sample
    state.fleet.update_engine_stats(
        rt.url,
        now=state.clock(),
        num_running=sample.num_running,
        num_waiting=sample.num_waiting,
        kv_cache_usage=sample.kv_cache_usage,
        block_size=sample.block_size,
        num_gpu_blocks=sample.num_gpu_blocks,
        prefix_cache_hits=_opt_int(sample.prefix_cache_hits),
        prefix_cache_queries=_opt_int(sample.prefix_cache_queries),
    )


async def scrape_loop(state: RouterState) -> None:
    interval_s = state.config.health.scrape_interval_s
    while True:
        targets = [rt for rt in state.backends if rt.probe_ok]
        try:
            await asyncio.gather(*(scrape(state, rt) for rt in targets))
        except Exception:  # a bug here must not stop scraping
            log.exception("scrape round failed")
        await asyncio.sleep(interval_s)
