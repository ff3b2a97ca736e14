"""Issue 9, findings 6 and 4 (probe side): probes have their own connections and read
bounded bodies.

Finding 6: with the request pool of a backend full of held streams, health probes, model
discovery and scrapes still reach it, so a busy but healthy backend stays in routing.
Finding 4: a /health, /v1/models or /metrics body over its cap is a failed probe or
scrape with an error that says so, read no further than the cap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.router.config import HealthConfig, LimitConfig
from kvroute.router.health import METRICS_MAX_BYTES, PROBE_MAX_BYTES
from kvroute.router.scraper import scrape
from kvroute.router.state import RouterState
from tests.conftest import until
from tests.router.conftest import Harness

# engine gauges as a scrape finds them (nothing running: the leak check counts them)
GAUGES = "vllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.25\n"
NORMAL = {
    "/health": b"",
    "/v1/models": b'{"object": "list", "data": [{"id": "m1", "object": "model"}]}',
    "/metrics": GAUGES.encode(),
}
# far over each cap: more than the cap plus what loopback socket buffers take in
OVER = 24 * 1024 * 1024


async def test_full_request_pool_does_not_fail_probes(harness: Harness) -> None:
    b = await harness.backend("b")
    b.state.chunk_delay_s = 0.2  # each stream holds its pooled connection for ~12 s
    b.state.num_chunks = 60
    b.state.metrics_text = GAUGES
    client = await harness.router(
        [b.url],
        limits=LimitConfig(max_connections_per_backend=2, retry_backoff_s=0.0),
        health=HealthConfig(
            interval_s=0.05, timeout_s=0.3, unhealthy_after=2, scrape_interval_s=0.05
        ),
    )
    state = harness.state(client)
    rt = state.backends.get(b.url)
    assert rt is not None and rt.probe_ok
    body = {"model": "m1", "prompt": "hold", "stream": True}
    held = [await client.post("/v1/completions", json=body) for _ in range(2)]
    try:
        assert all(r.status == 200 for r in held)
        await until(lambda: b.state.num_active == 2)
        start = rt.probe_successes
        rt.engine = None
        # several probe rounds (each longer than the probe timeout if it had to queue)
        await until(lambda: rt.probe_successes >= start + 8, 4.0)
        await until(lambda: rt.engine is not None and rt.engine.kv_cache_usage == 0.25, 4.0)
        assert rt.probe_ok and rt.routable and rt.probe_failures == 0
        assert b.state.num_active == 2, "the held streams are still running"
    finally:
        for r in held:
            r.close()


class Oversized:
    """A backend whose /health, /v1/models and /metrics bodies have a chosen size; bodies
    are chunked (no Content-Length), so only a bounded read can stop them."""

    def __init__(self) -> None:
        self.sizes = {"/health": 0, "/v1/models": 0, "/metrics": 0}  # 0: a normal answer
        self.sent: dict[str, int] = {}
        app = web.Application()
        for path in self.sizes:
            app.router.add_get(path, self._answer)
        self.server = TestServer(app, host="127.0.0.1")

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        size = self.sizes[request.path]
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if size == 0:
            await resp.write(NORMAL[request.path])
        else:
            prefix = b'{"data": [' if request.path == "/v1/models" else b"# "
            self.sent[request.path] = 0
            await resp.write(prefix)
            chunk = b"x" * 65536
            try:
                while self.sent[request.path] < size:
                    await resp.write(chunk)
                    self.sent[request.path] += len(chunk)
            except (ConnectionError, RuntimeError):
                return resp  # the prober stopped reading and closed
        await resp.write_eof()
        return resp


@pytest.fixture
async def oversized() -> AsyncIterator[Oversized]:
    o = Oversized()
    await o.server.start_server()
    yield o
    await o.server.close()


def _url(o: Oversized) -> str:
    return str(o.server.make_url("")).rstrip("/")


async def _probe_round(state: RouterState) -> None:
    from kvroute.router.health import probe_all

    await probe_all(state)


@pytest.mark.parametrize(
    ("path", "size", "error"),
    [
        ("/health", PROBE_MAX_BYTES + OVER, "/health: body over"),
        ("/v1/models", PROBE_MAX_BYTES + OVER, "/v1/models: body over"),
    ],
)
async def test_oversized_probe_bodies_fail_the_probe(
    harness: Harness, oversized: Oversized, path: str, size: int, error: str
) -> None:
    url = _url(oversized)
    client = await harness.router(
        [url],
        health=HealthConfig(interval_s=3600, timeout_s=5.0, unhealthy_after=1, scrape_interval_s=0),
    )
    state = harness.state(client)
    rt = state.backends.get(url)
    assert rt is not None and rt.probe_ok and rt.models == ("m1",)
    oversized.sizes[path] = size
    await _probe_round(state)
    assert not rt.probe_ok
    assert rt.last_error is not None and error in rt.last_error, rt.last_error
    assert oversized.sent[path] < size, "the prober read no further than its cap"
    oversized.sizes[path] = 0
    await _probe_round(state)
    assert rt.probe_ok and rt.models == ("m1",)


async def test_oversized_metrics_page_fails_the_scrape(
    harness: Harness, oversized: Oversized
) -> None:
    url = _url(oversized)
    client = await harness.router([url])
    state = harness.state(client)
    rt = state.backends.get(url)
    assert rt is not None and rt.probe_ok
    oversized.sizes["/metrics"] = METRICS_MAX_BYTES + OVER
    error = await scrape(state, rt)
    assert error is not None and "/metrics: body over" in error
    assert rt.engine is None
    assert oversized.sent["/metrics"] < METRICS_MAX_BYTES + OVER
    oversized.sizes["/metrics"] = 0
    assert await scrape(state, rt) is None
    assert rt.engine is not None and rt.engine.kv_cache_usage == 0.25
