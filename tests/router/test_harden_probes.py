"""Issue 9, findings 6 and 4 (probe side): probes have their own connections and read
bounded bodies.

Finding 6: with the request pool of a backend full of held streams, health probes, model
discovery and scrapes still reach it, so a busy but healthy backend stays in routing.
Finding 4: a /health, /v1/models or /metrics body over its cap is a failed probe or
scrape with an error that says so, read no further than the cap.
"""

from __future__ import annotations

from kvroute.router.config import HealthConfig, LimitConfig
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
