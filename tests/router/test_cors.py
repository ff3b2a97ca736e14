"""CORS for browser apps: off by default; allowed origins get preflights and stamped
answers (streams and errors included); others get nothing."""

from __future__ import annotations

import pytest

from kvroute.router.config import ServerConfig
from kvroute.router.config_sections import ClientKey
from tests.router.conftest import Harness

APP = "https://app.example.com"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = b'{"model": "m1", "prompt": "x", "max_tokens": 2}'


async def test_without_origins_there_is_no_cors(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    assert (await client.options("/v1/completions", headers=PREFLIGHT)).status == 405
    resp = await client.post("/v1/completions", data=BODY, headers={"Origin": APP})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_an_allowed_origin_gets_preflights_and_stamped_answers(harness: Harness) -> None:
    b = await harness.backend("a")
    key = ClientKey(name="web", key="client-key-123")
    client = await harness.router(
        [b.url], server=ServerConfig(cors_origins=(APP + "/",)), client_keys=(key,)
    )
    pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status == 204  # before the key check: a preflight carries no key
    assert pre.headers["Access-Control-Allow-Origin"] == APP
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    auth = {"Origin": APP, "Authorization": "Bearer client-key-123"}
    for body in (BODY, BODY[:-1] + b', "stream": true}'):
        resp = await client.post("/v1/completions", data=body, headers=auth)
        await resp.read()
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] == APP
        assert "Origin" in resp.headers.getall("Vary")
        assert "x-request-id" in resp.headers["Access-Control-Expose-Headers"]
    denied = await client.post("/v1/completions", data=BODY, headers={"Origin": APP})
    assert denied.status == 401  # the page can read why
    assert denied.headers["Access-Control-Allow-Origin"] == APP
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    resp = await client.options("/v1/completions", headers=other)
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.post("/v1/completions", data=BODY, headers={**auth, **other})
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_star_allows_any_origin(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], server=ServerConfig(cors_origins=("*",)))
    resp = await client.post("/v1/completions", data=BODY, headers={"Origin": "http://x:3000"})
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in resp.headers


@pytest.mark.parametrize("bad", ["app.example.com", "https://a/path", "ftp://a", "", "https://u@a"])
def test_an_origin_is_scheme_host_and_port(bad: str) -> None:
    with pytest.raises(ValueError, match=r"server\.cors_origins"):
        ServerConfig(cors_origins=(bad,))
