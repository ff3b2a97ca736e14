"""Metrics scraper: reads each backend's engine gauges and feeds Fleet.update_engine_stats.

Runs in the background, never on the request path. The page is parsed by
``kvroute.common.vllm_metrics`` (the names vLLM exports, old and new), the parser the
benchmarks use too.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvroute.common.vllm_metrics import RUNNING, EngineMetrics, parse_vllm_metrics
from kvroute.router.backends import BackendRuntime
from kvroute.router.health import METRICS_MAX_BYTES, BodyTooLarge, probe_headers, read_capped
from kvroute.router.state import RouterState

log = logging.getLogger("kvroute.router.scraper")


async def scrape(state: RouterState, rt: BackendRuntime) -> str | None:
    """Scrape one backend (on the probe pool, body capped); the error, None when it
    worked. Scraping is best effort: a failure leaves the last sample in place."""
    session = state.probe_session
    assert session is not None, "scrape runs after startup created the probe pool"
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s)
    try:
        async with session.get(
            rt.url + "/metrics", timeout=timeout, headers=probe_headers(rt), allow_redirects=False
        ) as r:
            if r.status != 200:
                return f"/metrics answered {r.status}"
            raw = await read_capped(r, "/metrics", METRICS_MAX_BYTES)
        sample = parse_vllm_metrics(raw.decode())
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
    if sample.num_running is None and sample.num_waiting is None:  # said once, as failures
        return f"/metrics has no load gauge kvroute reads ({', '.join(RUNNING)})"
    return None


def apply_sample(state: RouterState, rt: BackendRuntime, sample: EngineMetrics) -> None:
    rt.engine = sample
    state.fleet.update_engine_stats(
        rt.url,
        num_running=sample.num_running,
        num_waiting=sample.num_waiting,
        kv_cache_usage=sample.kv_cache_usage,
        block_size=sample.block_size,
        num_gpu_blocks=sample.num_gpu_blocks,
        prefix_cache_hits=_opt_int(sample.prefix_cache_hits),
        prefix_cache_queries=_opt_int(sample.prefix_cache_queries),
    )


def _opt_int(value: float | None) -> int | None:
    return None if value is None else round(value)


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
