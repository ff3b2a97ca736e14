"""Failover before the first byte, no retry after it, and the circuit breaker."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient

from kvroute.bench.fake_backend import FakeBackend
from kvroute.router.backends import BackendRuntime
from kvroute.router.breaker import CircuitState
from kvroute.router.config import BreakerConfig, TimeoutConfig
from kvroute.router.state import RouterState
from tests.conftest import until
from tests.router.conftest import FakeClock, Harness

BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 4}'
STREAM = b'{"model": "m1", "prompt": "hello", "stream": true}'


def _dead_url() -> str:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_connection_refused_fails_over_without_losing_requests(harness: Harness) -> None:
    good = await harness.backend("good")
    bad = await harness.backend("bad")
    client = await harness.router([good.url, bad.url])
    await bad.close()  # healthy at startup, dead now
    statuses = []
    for _ in range(8):
        resp = await client.post("/v1/completions", data=BODY)
        statuses.append(resp.status)
        assert resp.headers["x-kvroute-backend"] == good.url
        await resp.read()
    assert statuses == [200] * 8
    registry = harness.state(client).metrics.registry
    retries = registry.get_sample_value(
        "kvroute_retries_total", {"backend": bad.url, "cause": "connect"}
    )
    assert retries is not None and retries >= 1


async def test_5xx_is_retried_elsewhere_with_retry_decision(harness: Harness) -> None:
    good = await harness.backend("good")
    bad = await harness.backend("bad")
    bad.state.fail_status = 503
    client = await harness.router([bad.url, good.url])
    reasons = set()
    for _ in range(4):
        resp = await client.post("/v1/completions", data=BODY)
        assert resp.status == 200
        assert resp.headers["x-kvroute-backend"] == good.url
        reasons.add(resp.headers["x-kvroute-decision"])
    assert "retry" in reasons  # the attempts that hit `bad` first were retried
    assert len(good.state.requests) == 4


async def test_all_backends_failing_gives_502(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    a.state.fail_status = b.state.fail_status = 500
    client = await harness.router([a.url, b.url])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 502
    err = (await resp.json())["error"]
    assert err["code"] == "backend_failed"
    assert "answered 500" in err["message"]
    # a 500 may be this body's doing: answered at once, not run on the other backend
    assert len(a.state.requests) + len(b.state.requests) == 1


async def test_slow_answer_is_not_retried_504(harness: Harness) -> None:
    slow = await harness.backend("slow")
    fast = await harness.backend("fast")
    slow.state.stall_s = 5.0
    client = await harness.router([slow.url, fast.url], timeouts=TimeoutConfig(response_s=0.2))
    statuses = []
    for _ in range(2):
        resp = await client.post("/v1/completions", data=BODY)
        statuses.append(resp.status)
        if resp.status == 504:
            assert (await resp.json())["error"]["code"] == "backend_timeout"
    assert sorted(statuses) == [200, 504]
    assert len(slow.state.requests) == len(fast.state.requests) == 1


async def test_no_healthy_backend_gives_503(harness: Harness) -> None:
    client = await harness.router([_dead_url()])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "no_healthy_backend"
    # the next health probe (the harness probes hourly): capped at a minute
    assert resp.headers["Retry-After"] == "60"
    health = await client.get("/health")
    assert health.status == 503


async def test_midstream_failure_ends_with_sse_error_and_is_not_retried(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    for fb in (a, b):
        fb.state.die_after_chunks = 2
        fb.state.chunk_delay_s = 0.01
    client = await harness.router([a.url, b.url])
    resp = await client.post("/v1/completions", data=STREAM)
    assert resp.status == 200
    text = (await resp.read()).decode()
    assert '"i": 0' in text and '"i": 1' in text
    assert text.rstrip().endswith("data: [DONE]")
    assert 'data: {"error":' in text
    # the same code as a 502 answered before the first byte: a string, as OpenAI's
    event = next(line for line in text.splitlines() if line.startswith('data: {"error"'))
    assert json.loads(event[6:])["error"]["code"] == "backend_failed"
    assert len(a.state.requests) + len(b.state.requests) == 1  # never sent twice


async def test_stream_idle_gap_timeout_ends_with_sse_error(harness: Harness) -> None:
    b = await harness.backend("a")
    b.state.chunk_delay_s = 0.5
    client = await harness.router([b.url], timeouts=TimeoutConfig(idle_s=0.1))
    resp = await client.post("/v1/completions", data=STREAM)
    text = (await resp.read()).decode()
    assert '"code":"backend_timeout"' in text
    assert text.endswith("data: [DONE]\n\n")
    await until(lambda: b.state.num_aborted > 0)
    assert b.state.num_aborted == 1  # the stalled upstream was cancelled


@dataclass
class _Tripping:
    """A router in front of a failing backend ("bad") and a good one, on a fake clock."""

    clock: FakeClock
    client: TestClient[Any, Any]
    state: RouterState
    bad: FakeBackend
    rt: BackendRuntime

    async def trip(self, num_requests: int) -> int:
        """Send requests (all answered by failover) until the bad backend's circuit is
        open; returns how many reached it."""
        for _ in range(num_requests):
            assert (await self.client.post("/v1/completions", data=BODY)).status == 200
        assert self.rt.breaker.state is CircuitState.OPEN
        return len(self.bad.state.requests)

    def wait_out(self, seconds: float) -> None:
        """Let ``seconds`` pass on the fake clock and the health loop notice."""
        self.clock.advance(seconds)
        self.state.backends.refresh()


async def _tripping(harness: Harness, breaker: BreakerConfig) -> _Tripping:
    clock = FakeClock()
    good = await harness.backend("good")
    bad = await harness.backend("bad")
    bad.state.fail_status = 503  # "cannot take work": retried elsewhere, counted
    client = await harness.router([bad.url, good.url], clock=clock, breaker=breaker)
    state = harness.state(client)
    rt = state.backends.get(bad.url)
    assert rt is not None
    return _Tripping(clock, client, state, bad, rt)


async def test_circuit_opens_then_half_opens_then_closes(harness: Harness) -> None:
    t = await _tripping(
        harness, BreakerConfig(failure_threshold=2, open_s=10.0, half_open_successes=1)
    )
    client, bad, rt = t.client, t.bad, t.rt
    tried = await t.trip(6)
    assert tried == 2
    for _ in range(4):
        await client.post("/v1/completions", data=BODY)
    assert len(bad.state.requests) == tried  # open: no traffic
    t.wait_out(11.0)
    assert rt.breaker.state is CircuitState.HALF_OPEN
    bad.state.fail_status = None  # recovered
    for _ in range(4):
        await client.post("/v1/completions", data=BODY)
    assert len(bad.state.requests) > tried
    assert rt.breaker.state is CircuitState.CLOSED


async def test_half_open_failure_reopens(harness: Harness) -> None:
    t = await _tripping(harness, BreakerConfig(failure_threshold=1, open_s=5.0))
    client, state, rt = t.client, t.state, t.rt
    await client.post("/v1/completions", data=BODY)
    await client.post("/v1/completions", data=BODY)
    assert rt.breaker.state is CircuitState.OPEN
    t.clock.advance(6.0)
    state.backends.refresh()
    for _ in range(2):
        assert (await client.post("/v1/completions", data=BODY)).status == 200
    assert rt.breaker.state is CircuitState.OPEN


async def test_client_disconnect_mid_stream_cancels_upstream_and_releases(
    harness: Harness,
) -> None:
    b = await harness.backend("a")
    b.state.num_chunks = 100
    b.state.chunk_delay_s = 0.02
    client = await harness.router([b.url])
    url = client.make_url("/v1/completions")
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, data=STREAM)
        first = await resp.content.readany()
        assert first.startswith(b"data:")
        resp.close()  # the client goes away mid-stream
    await until(lambda: b.state.num_aborted > 0)
    assert b.state.num_aborted == 1
    await harness.settle()
    state = harness.state(client)
    assert all(s.in_flight_requests == 0 for s in state.fleet.backend_states())


async def test_client_disconnect_before_first_byte_cancels_upstream(harness: Harness) -> None:
    b = await harness.backend("a")
    b.state.stall_s = 5.0
    client = await harness.router([b.url])
    url = client.make_url("/v1/completions")
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(url, data=BODY))
        await until(lambda: b.state.num_active > 0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await until(lambda: b.state.num_active == 0)  # the backend saw the disconnect, stopped


async def test_half_open_sends_one_trial_at_a_time(harness: Harness) -> None:
    """A backend back from an open circuit gets one request until that one answers."""
    t = await _tripping(
        harness, BreakerConfig(failure_threshold=1, open_s=5.0, half_open_successes=1)
    )
    client, state, bad, rt = t.client, t.state, t.bad, t.rt
    before = await t.trip(3)
    t.wait_out(6.0)
    bad.state.fail_status = None
    bad.state.stall_s = 0.3  # recovered, but slow: the trial stays in flight a while
    statuses = await asyncio.gather(
        *(_status(client.post("/v1/completions", data=BODY)) for _ in range(8))
    )
    assert statuses == [200] * 8
    assert len(bad.state.requests) - before == 1, "one trial, the rest went elsewhere"
    assert rt.breaker.state is CircuitState.CLOSED
    assert not rt.breaker.trial_in_flight
    assert all(s.in_flight_requests == 0 for s in state.fleet.backend_states())


async def _status(request) -> int:  # type: ignore[no-untyped-def]
    async with request as resp:
        await resp.read()
        return resp.status
