"""Client API keys: 401 without a valid key, 429 with Retry-After over a limit."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.clients import ClientGate, client_address
from kvroute.router.config import ClientKey
from kvroute.router.errors import RateLimited, Unauthorized
from tests.conftest import until
from tests.router.conftest import FakeClock, Harness

BODY = b'{"model": "m1", "prompt": "x"}'
KEY = "sk-test-0001"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_or_bad_key_is_401(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], client_keys=(ClientKey(name="t", key=KEY),))
    for headers in ({}, _auth("sk-wrong-key"), {"Authorization": KEY}):
        resp = await client.post("/v1/completions", data=BODY, headers=headers)
        assert resp.status == 401
        assert (await resp.json())["error"]["type"] == "authentication_error"
    assert (await client.get("/v1/models")).status == 401
    resp = await client.post("/v1/completions", data=BODY, headers=_auth(KEY))
    assert resp.status == 200
    # the router's client key is never forwarded upstream
    assert "Authorization" not in b.state.requests[-1]["headers"]


async def test_backend_api_key_sent_upstream(harness: Harness) -> None:
    from kvroute.router.config import BackendConfig

    b = await harness.backend("a")
    client = await harness.router([])
    state = harness.state(client)
    rt = state.backends.add(BackendConfig(url=b.url, api_key="backend-secret"))
    state.backends.record_probe(rt.url, True)
    resp = await client.post("/v1/completions", data=BODY, headers=_auth("client-own-key"))
    assert resp.status == 200
    assert b.state.requests[-1]["headers"]["Authorization"] == "Bearer backend-secret"


async def test_concurrency_limit_429_with_retry_after(harness: Harness) -> None:
    b = await harness.backend("a")
    b.state.stall_s = 0.3
    client = await harness.router(
        [b.url], client_keys=(ClientKey(name="t", key=KEY, max_concurrency=1),)
    )
    first = asyncio.ensure_future(client.post("/v1/completions", data=BODY, headers=_auth(KEY)))
    await until(lambda: b.state.num_active == 1)
    second = await client.post("/v1/completions", data=BODY, headers=_auth(KEY))
    assert second.status == 429
    assert second.headers["Retry-After"] == "1"
    assert (await second.json())["error"]["code"] == "rate_limit_exceeded"
    assert (await first).status == 200


async def test_rate_limit_429_then_recovers() -> None:
    clock = FakeClock()
    gate = ClientGate([ClientKey(name="t", key=KEY, rate_per_s=0.5, burst=2)], clock)
    auth = f"Bearer {KEY}"
    gate.release(gate.admit(auth))
    gate.release(gate.admit(auth))
    with pytest.raises(RateLimited) as info:
        gate.admit(auth)
    assert info.value.headers["Retry-After"] == "2"  # one token takes 2 s at 0.5/s
    clock.advance(2.0)
    gate.release(gate.admit(auth))
    with pytest.raises(Unauthorized):
        gate.admit("Bearer nope-nope")


def test_x_forwarded_for_trusted_only_from_configured_proxies() -> None:
    import ipaddress

    trusted = (ipaddress.ip_network("10.0.0.0/8"),)
    # untrusted peer: the header is ignored
    assert client_address("1.2.3.4", "9.9.9.9", trusted) == "1.2.3.4"
    # trusted proxy: the rightmost untrusted hop is the client
    assert client_address("10.0.0.5", "6.6.6.6, 9.9.9.9, 10.0.0.7", trusted) == "9.9.9.9"
    # no trusted proxies configured: never believed
    assert client_address("10.0.0.5", "9.9.9.9", ()) == "10.0.0.5"


async def test_forwarded_for_sent_upstream_only_trusted(harness: Harness) -> None:
    import ipaddress

    b = await harness.backend("a")
    client = await harness.router([b.url])
    await client.post("/v1/completions", data=BODY, headers={"X-Forwarded-For": "6.6.6.6"})
    assert b.state.requests[-1]["headers"]["X-Forwarded-For"] == "127.0.0.1"  # spoof dropped
    trusting = await harness.router([b.url], trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
    await trusting.post("/v1/completions", data=BODY, headers={"X-Forwarded-For": "9.9.9.9"})
    assert b.state.requests[-1]["headers"]["X-Forwarded-For"] == "9.9.9.9, 127.0.0.1"
