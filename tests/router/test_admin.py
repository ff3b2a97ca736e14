"""Admin API behind its key, drain, graceful shutdown, /health, /metrics and the status page."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from tests.conftest import until
from tests.router.conftest import Harness

ADMIN = "admin-key-123"
BODY = b'{"model": "m1", "prompt": "x"}'


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


async def test_admin_requires_its_key(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], admin_key=ADMIN)
    assert (await client.get("/admin/backends")).status == 401
    bad = {"Authorization": "Bearer wrong-key-000"}
    assert (await client.get("/admin/backends", headers=bad)).status == 401
    resp = await client.get("/admin/backends", headers=_admin())
    assert resp.status == 200
    rows = (await resp.json())["backends"]
    assert [r["url"] for r in rows] == [b.url]
    assert rows[0]["kvroute_backend_healthy"] == 1


async def test_admin_disabled_without_key(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.get("/admin/backends", headers=_admin())
    assert resp.status == 403


async def test_admin_add_and_remove_backend(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    client = await harness.router([a.url], admin_key=ADMIN)
    resp = await client.post("/admin/backends", json={"url": b.url}, headers=_admin())
    assert resp.status == 201
    assert (await resp.json())["healthy"] is True
    seen = set()
    for _ in range(4):
        seen.add((await client.post("/v1/completions", data=BODY)).headers["x-kvroute-backend"])
    assert seen == {a.url, b.url}
    dup = await client.post("/admin/backends", json={"url": b.url}, headers=_admin())
    assert dup.status == 400
    bad = await client.post("/admin/backends", json={"url": "ftp://x"}, headers=_admin())
    assert bad.status == 400
    label = f'backend="{a.url}"'
    assert label in await (await client.get("/metrics")).text()
    resp = await client.delete("/admin/backends", json={"url": a.url}, headers=_admin())
    assert resp.status == 200
    for _ in range(3):
        resp = await client.post("/v1/completions", data=BODY)
        assert resp.headers["x-kvroute-backend"] == b.url
    text = await (await client.get("/metrics")).text()
    assert label not in text, "a removed backend's series are dropped"
    assert f'backend="{b.url}"' in text
    gone = await client.delete("/admin/backends", json={"url": a.url}, headers=_admin())
    assert gone.status == 404


async def test_drain_stops_new_requests_and_lets_in_flight_finish(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    a.state.stall_s = b.state.stall_s = 0.2
    client = await harness.router([a.url, b.url], admin_key=ADMIN)
    in_flight = asyncio.ensure_future(client.post("/v1/completions", data=BODY))
    await until(lambda: a.state.num_active + b.state.num_active == 1)
    busy, other = (a, b) if a.state.num_active else (b, a)
    a.state.stall_s = b.state.stall_s = 0.0
    resp = await client.post("/admin/backends/drain", json={"url": busy.url}, headers=_admin())
    assert resp.status == 200
    assert (await resp.json())["in_flight"] == 1
    for _ in range(4):
        r = await client.post("/v1/completions", data=BODY)
        assert r.headers["x-kvroute-backend"] == other.url
    first = await in_flight
    assert first.status == 200
    assert first.headers["x-kvroute-backend"] == busy.url
    undrain = {"url": busy.url, "draining": False}
    await client.post("/admin/backends/drain", json=undrain, headers=_admin())
    seen = set()
    for _ in range(4):
        seen.add((await client.post("/v1/completions", data=BODY)).headers["x-kvroute-backend"])
    assert busy.url in seen


async def test_graceful_shutdown_finishes_in_flight_requests(harness: Harness) -> None:
    from aiohttp import web

    from kvroute.router.app import make_app
    from tests.router.conftest import assert_no_load, router_config

    b = await harness.backend("a")
    b.state.stall_s = 0.3
    app = make_app(router_config([b.url]))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    async with aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(s.post(f"http://{host}:{port}/v1/completions", data=BODY))
        await until(lambda: b.state.num_active == 1)
        await runner.cleanup()  # stop listening, wait for in-flight requests, then close
        resp = await pending
        assert resp.status == 200
        await resp.read()
    from kvroute.router.state import STATE

    assert_no_load(app[STATE])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_requests_left_at_the_drain_timeout_are_ended_with_a_reason(
    harness: Harness, stream: bool
) -> None:
    """aiohttp cancels a handler only after its shutdown timeout and then waits as long
    again for one that does not read its request: a stream ran twice the drain timeout
    and was then cut silently (a whole answer's connection just dropped). At the drain
    timeout the router now ends each itself: an SSE error event and [DONE], or a 503."""
    from kvroute.router.app import make_app
    from kvroute.router.listener import start_listeners
    from kvroute.router.state import STATE
    from tests.router.conftest import assert_no_load, router_config

    b = await harness.backend("a")
    if stream:
        b.state.chunk_gaps_s = (0.0, 3600.0)  # a first token, then silence
    else:
        b.state.hang = True
    config = router_config([b.url], port=0, drain_timeout_s=0.2)
    app = make_app(config)
    listeners = await start_listeners(app, config)
    host, port = listeners.api
    body = b'{"model": "m1", "prompt": "x", "stream": %s}' % (b"true" if stream else b"false")
    async with aiohttp.ClientSession() as s:
        resp_or_none: list[aiohttp.ClientResponse] = []

        async def ask() -> bytes:
            resp = await s.post(f"http://{host}:{port}/v1/completions", data=body)
            resp_or_none.append(resp)
            return await resp.read()

        pending = asyncio.ensure_future(ask())
        await until(lambda: b.state.num_active == 1)
        if stream:
            await until(lambda: bool(resp_or_none))  # its first chunk came through
        await listeners.runner.cleanup()
        answer = await pending
    (resp,) = resp_or_none
    if stream:
        assert resp.status == 200
        events = answer.decode().strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "no_healthy_backend" and "shut down" in error["message"]
    else:
        assert resp.status == 503
        assert "shut down" in json.loads(answer)["error"]["message"]
    assert_no_load(app[STATE])


async def test_health_metrics_and_status_page(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    health = await client.get("/health")
    assert health.status == 200
    assert (await health.json())["healthy_backends"] == 1
    await client.post("/v1/completions", data=BODY)
    await client.post("/v1/completions", data=b'{"model": "m1", "prompt": "x", "stream": true}')
    text = await (await client.get("/metrics")).text()
    for name in (
        "kvroute_requests_total",
        "kvroute_ttft_seconds_bucket",
        "kvroute_e2e_seconds_bucket",
        "kvroute_decision_seconds_bucket",
        "kvroute_backend_in_flight_requests",
        "kvroute_backend_circuit_state",
        "kvroute_backend_predicted_hit_rate",
        "kvroute_backend_hot_blocks",
        "kvroute_index_blocks",
    ):
        assert name in text, name
    assert (
        f'kvroute_requests_total{{backend="{b.url}",reason="round_robin",status="200"}} 2.0' in text
    )
    page = await client.get("/")
    assert page.status == 200
    html = await page.text()
    assert 'http-equiv="refresh"' in html
    assert b.url in html and "healthy" in html


async def test_unhealthy_backend_detected_by_probe(harness: Harness) -> None:
    from kvroute.router.health import probe_all

    a = await harness.backend("a")
    b = await harness.backend("b")
    client = await harness.router([a.url, b.url])
    state = harness.state(client)
    b.state.health_status = 503
    for _ in range(state.config.health.unhealthy_after):
        await probe_all(state)
    assert state.backends.num_routable == 1
    for _ in range(3):
        r = await client.post("/v1/completions", data=BODY)
        assert r.headers["x-kvroute-backend"] == a.url
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["m1"]
    a.state.health_status = 503
    for _ in range(state.config.health.unhealthy_after):
        await probe_all(state)
    assert (await client.get("/health")).status == 503
    r = await client.post("/v1/completions", data=BODY)
    assert r.status == 503  # model known, but no healthy backend: 503, not 404


async def test_health_is_503_while_every_backend_drains(harness: Harness) -> None:
    """A load balancer in front reads /health as readiness: with every backend drained
    each request got 503 while /health said 200 "ok" (a review found it)."""
    a, b = await harness.backend("a"), await harness.backend("b")
    client = await harness.router([a.url, b.url], admin_key=ADMIN)
    for fb in (a, b):
        await client.post("/admin/backends/drain", json={"url": fb.url}, headers=_admin())
        health = await client.get("/health")
        body = await health.json()
        assert body["healthy_backends"] == 2
        if fb is a:  # one still serves
            assert health.status == 200 and body["serving_backends"] == 1
    assert health.status == 503 and body["serving_backends"] == 0
    assert body["status"] == "every healthy backend is draining"
    assert (await client.post("/v1/completions", data=BODY)).status == 503
    undrain = {"url": b.url, "draining": False}
    await client.post("/admin/backends/drain", json=undrain, headers=_admin())
    assert (await client.get("/health")).status == 200


async def test_a_router_without_backends_answers_503_not_404(harness: Harness) -> None:
    """With every backend removed a request got 404 model_not_found: the model is not
    unknown, the fleet is empty."""
    a = await harness.backend("a")
    client = await harness.router([a.url], admin_key=ADMIN)
    resp = await client.delete("/admin/backends", json={"url": a.url}, headers=_admin())
    assert resp.status == 200
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 503
    assert "no backend" in (await resp.json())["error"]["message"]
    assert (await client.get("/health")).status == 503


async def test_every_change_to_the_fleet_is_logged_with_who_asked(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    client = await harness.router([a.url], admin_key=ADMIN)
    caplog.set_level(logging.INFO, logger="kvroute.router.admin")
    await client.post("/admin/backends", json={"url": b.url}, headers=_admin())
    await client.post("/admin/backends/drain", json={"url": b.url}, headers=_admin())
    await client.post("/admin/backends/drain?url=" + b.url, json={"draining": False},
                      headers=_admin())  # fmt: skip
    await client.delete("/admin/backends", json={"url": b.url}, headers=_admin())
    await client.delete("/admin/backends", json={"url": b.url}, headers=_admin())  # 404
    await client.post("/admin/backends", json={"url": b.url})  # no key: 401
    lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.router.admin"]
    assert lines == [
        f"admin: {what} backend {b.url} (from 127.0.0.1)"
        for what in ("added", "drained", "undrained", "removed")
    ]
