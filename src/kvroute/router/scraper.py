"""Metrics scraper: reads each backend's vLLM gauges and feeds Fleet.update_engine_stats.

Runs in the background, never on the request path. The page is first cut down to the
few families we read (a vLLM page has hundreds of lines of histograms), then parsed with
``prometheus_client.parser``. Series of one family (per engine, per model) are summed.
"""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.backends import BackendRuntime, EngineSample
from kvroute.router.health import METRICS_MAX_BYTES, BodyTooLarge, probe_headers, read_capped
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
            elif math.isfinite(sample.value) and sample.value >= 0:
                # a negative, NaN or infinite gauge is not a state (and round() would raise)
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
        value = float(raw) if raw not in (None, "", "None") else math.nan
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value > 0 else None


async def scrape(state: RouterState, rt: BackendRuntime) -> str | None:
    """Scrape one backend (on the probe pool, body capped); the error, None when it
    worked. Scraping is best effort: a failure leaves the last sample in place."""
    session = state.probe_session
    assert session is not None, "scrape runs after startup created the probe pool"
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s)
    try:
        async with session.get(
            rt.url + "/metrics", timeout=timeout, headers=probe_headers(rt)
        ) as r:
            if r.status != 200:
                return f"/metrics answered {r.status}"
            raw = await read_capped(r, "/metrics", METRICS_MAX_BYTES)
        sample = parse_engine_metrics(raw.decode())
    except BodyTooLarge as exc:
        return str(exc)
    except UnicodeDecodeError:
        return "/metrics: not UTF-8"
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return f"/metrics: {type(exc).__name__}: {exc}"
    except ValueError as exc:
        return f"/metrics unreadable: {exc}"
    # removed, or out of routing, while we waited: the sample would write back gauges
    # that turning unroutable has just cleared
    if state.backends.get(rt.url) is rt and rt.routable:
        apply_sample(state, rt, sample)
    return None


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
    """Scrape every healthy backend each ``scrape_interval_s``; a backend's failure is
    logged when it starts (a warning) and when it ends, not every round."""
    interval_s = state.config.health.scrape_interval_s
    url_to_error: dict[str, str] = {}
    while True:
        targets = [rt for rt in state.backends if rt.probe_ok]
        try:
            errors = await asyncio.gather(*(scrape(state, rt) for rt in targets))
            for rt, error in zip(targets, errors, strict=True):
                _log_change(rt.url, url_to_error.get(rt.url), error)
            url_to_error = {rt.url: e for rt, e in zip(targets, errors, strict=True) if e}
        except Exception:  # a bug here must not stop scraping
            log.exception("scrape round failed")
        await asyncio.sleep(interval_s)


def _log_change(url: str, before: str | None, now: str | None) -> None:
    if now is not None and before is None:
        log.warning("scrape of %s failed: %s", url, now)
    elif now is None and before is not None:
        log.info("scrape of %s works again", url)
