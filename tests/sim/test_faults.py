"""Fault injection: each fault, set at start or at run time, does what it says."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvroute.sim.cli import faults_by_backend
from kvroute.sim.faults import Faults, parse_fault_spec
from kvroute.sim.server import start_fleet
from tests.conftest import until
from tests.sim.helpers import post, scrape

BODY = {"prompt": "fault test prompt", "max_tokens": 8}


async def _set(session, url: str, changes) -> tuple[int, dict]:
    return await post(session, url + "/sim/faults", changes)


@pytest.mark.parametrize("status", [500, 503])
async def test_error_fault_fails_completions_with_that_status(fleet, session, status):
    a, b = fleet.urls
    code, faults = await _set(session, a, {"error": status})
    assert code == 200 and faults["error_status"] == status
    for path in ("/v1/completions", "/v1/chat/completions"):
        code, body = await post(session, a + path, BODY)
        assert code == status and body["error"]["code"] == status
    assert (await post(session, b + "/v1/completions", BODY))[0] == 200  # per backend
    async with session.get(a + "/health") as resp:
        assert resp.status == 200


async def test_clear_restores_service(fleet, session):
    url = fleet.urls[0]
    await _set(session, url, {"error": 500, "unhealthy": True})
    async with session.delete(url + "/sim/faults") as resp:
        assert await resp.json() == Faults().to_json()
    assert (await post(session, url + "/v1/completions", BODY))[0] == 200
    await _set(session, url, {"error": 503})
    await _set(session, url, {"clear": True, "slow": 2})
    async with session.get(url + "/sim/faults") as resp:
        assert await resp.json() == {**Faults().to_json(), "slow_factor": 2.0}


async def test_unhealthy_fault_fails_health_only(fleet, session):
    url = fleet.urls[1]
    await _set(session, url, {"unhealthy": True})
    async with session.get(url + "/health") as resp:
        assert resp.status == 503
    assert (await post(session, url + "/v1/completions", BODY))[0] == 200


async def test_hang_fault_never_answers_and_frees_nothing(fleet, session):
    url = fleet.urls[0]
    await _set(session, url, {"hang": True})
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        async with session.post(url + "/v1/completions", json=BODY, timeout=timeout) as resp:
            await resp.read()
    backend = fleet.backends[0]
    assert not backend.engine.has_unfinished_requests()
    await until(lambda: not backend.hung)  # the server notices the disconnect, drops it
    await _set(session, url, {"hang": False})
    assert (await post(session, url + "/v1/completions", BODY))[0] == 200


async def test_slow_fault_scales_modelled_time(fleet, session):
    backend = fleet.backends[0]
    normal = backend.api_delay_s()
    await _set(session, fleet.urls[0], {"slow": 3.0})
    assert backend.api_delay_s() == pytest.approx(3 * normal)
    assert (await post(session, fleet.urls[0] + "/v1/completions", BODY))[0] == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_drop_fault_closes_the_connection_after_k_chunks(fleet, session, stream):
    url = fleet.urls[0]
    await _set(session, url, {"drop": 3})
    received = b""
    with pytest.raises(aiohttp.ClientError):
        async with session.post(url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
            async for chunk in resp.content.iter_any():
                received += chunk
    if stream:
        assert received.count(b"data: ") == 3 and b"[DONE]" not in received
    else:
        assert received == b""
    await until(lambda: not fleet.backends[0].engine.has_unfinished_requests())
    metrics = await scrape(session, url)
    assert metrics["vllm:request_success_total{finished_reason=abort}"] == 1


@pytest.mark.parametrize(
    "changes", [{"error": 404}, {"slow": 0}, {"drop": -1}, {"hang": "yes"}, {"bogus": 1}, [1]]
)
async def test_bad_fault_changes_are_refused_and_change_nothing(fleet, session, changes):
    code, body = await _set(session, fleet.urls[0], changes)
    assert code == 400 and body["error"]["type"] == "BadRequestError"
    async with session.get(fleet.urls[0] + "/sim/faults") as resp:
        assert await resp.json() == Faults().to_json()


async def test_faults_given_at_start_apply_per_backend(session):
    faults = faults_by_backend(["1=error:503", "all=unhealthy", "0=slow:2"], 2)
    fleet = await start_fleet(2, profile="tiny", faults=faults)
    try:
        a, b = fleet.urls
        assert (await post(session, a + "/v1/completions", BODY))[0] == 200
        assert (await post(session, b + "/v1/completions", BODY))[0] == 503
        for url in (a, b):
            async with session.get(url + "/health") as resp:
                assert resp.status == 503
        assert fleet.backends[0].faults.slow_factor == 2.0
    finally:
        await fleet.close()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0=error:500", (0, {"error": 500})),
        ("all=hang", (None, {"hang": True})),
        ("2=slow:1.5", (2, {"slow": 1.5})),
        ("1=drop:0", (1, {"drop": 0})),
        ("3=unhealthy", (3, {"unhealthy": True})),
    ],
)
def test_fault_specs_parse(spec, expected):
    assert parse_fault_spec(spec) == expected


@pytest.mark.parametrize(
    "spec", ["error:500", "x=hang", "0=explode", "0=error:418", "0=slow:abc", "-1=hang", "0=hang:1"]
)
def test_bad_fault_specs_raise(spec):
    with pytest.raises(ValueError):
        parse_fault_spec(spec)


def test_fault_index_out_of_range_raises():
    with pytest.raises(ValueError, match="no backend 5"):
        faults_by_backend(["5=hang"], 2)
