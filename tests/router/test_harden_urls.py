"""Issue 9, finding 9: backend URLs never carry credentials, and can stay hidden from clients.

Credentials in a URL (``http://user:pass@host``) are refused everywhere a URL enters the
router (YAML, ``--backend``, the admin API), without echoing the secret. With
``expose_backend_urls: false`` clients see a stable opaque id instead of the URL, in the
``x-kvroute-backend`` header and in error messages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.router.app import hide_backend_urls, make_app
from kvroute.router.config import BackendConfig, backend_public_id, load_config
from kvroute.router.state import STATE
from tests.router.conftest import Harness, router_config

SECRET = "hunter2-secret"
BODY = b'{"model": "m1", "prompt": "x"}'
ADMIN = "admin-key-123"


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{SECRET}@127.0.0.1:8001",
        f"https://{SECRET}@engine.internal:443",
        f"http://:{SECRET}@127.0.0.1:8001/",
    ],
)
def test_userinfo_is_refused_without_echoing_it(url: str) -> None:
    with pytest.raises(ValueError, match="api_key") as info:
        BackendConfig(url=url)
    assert SECRET not in str(info.value)


def test_userinfo_refused_in_yaml_and_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"backends:\n  - url: http://u:{SECRET}@127.0.0.1:8001\n")
    with pytest.raises(ValueError, match="api_key"):
        load_config(cfg)
    with pytest.raises(ValueError, match="api_key"):
        load_config(backends=[f"http://u:{SECRET}@127.0.0.1:8001"])
    argv = ["serve", "--backend", f"http://u:{SECRET}@127.0.0.1:9", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "api_key" in err and SECRET not in err


async def test_admin_add_with_userinfo_is_400(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url], admin_key=ADMIN)
    url = a.url.replace("http://", f"http://u:{SECRET}@")
    resp = await client.post(
        "/admin/backends", json={"url": url}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert resp.status == 400
    text = await resp.text()
    assert "api_key" in text and SECRET not in text


def test_public_ids_are_stable_and_opaque() -> None:
    url = "http://10.0.0.7:8000"
    pid = backend_public_id(url)
    assert pid == backend_public_id(url) and pid.startswith("b-") and len(pid) == 10
    assert "10.0.0.7" not in pid and pid != backend_public_id("http://10.0.0.8:8000")
    assert BackendConfig(url=url, name="gpu-a").public_id == "gpu-a"
    assert BackendConfig(url=url).public_id == pid
    with pytest.raises(ValueError, match="name"):
        BackendConfig(url=url, name="http://10.0.0.7:8000")


async def test_urls_shown_by_default(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.headers["x-kvroute-backend"] == a.url


async def test_hidden_urls_give_ids_in_headers_and_errors(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    named = BackendConfig(url=b.url, name="gpu-b")
    client = await harness.router(
        [a.url], backends=(BackendConfig(url=a.url), named), expose_backend_urls=False
    )
    seen = set()
    for _ in range(2):
        resp = await client.post("/v1/completions", data=BODY)
        assert resp.status == 200
        seen.add(resp.headers["x-kvroute-backend"])
    for stream in (False, True):
        body = b'{"model": "m1", "prompt": "x", "stream": %s}' % (b"true" if stream else b"false")
        resp = await client.post("/v1/completions", data=body)
        assert resp.headers["x-kvroute-backend"] in {backend_public_id(a.url), "gpu-b"}
        await resp.read()
    assert seen == {backend_public_id(a.url), "gpu-b"}
    # both backends die after their probes said healthy: the 502 names neither address
    host_port = a.url.removeprefix("http://")
    await a.close()
    await b.close()
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status in (502, 504)
    message = (await resp.json())["error"]["message"]
    for leaked in (a.url, b.url, host_port, "127.0.0.1", b.url.rsplit(":", 1)[1]):
        assert leaked not in message, message
    assert backend_public_id(a.url) in message or "gpu-b" in message


def test_hiding_rewrites_every_form_of_an_address() -> None:
    """Backends on one host: each URL, host:port and socket tuple becomes its own id."""
    a, b = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    config = router_config([a, b], expose_backend_urls=False)
    config = dataclasses.replace(
        config, backends=(BackendConfig(url=a), BackendConfig(url=b, name="gpu-b"))
    )
    state = make_app(config)[STATE]
    message = (
        f"last: {b}/v1/completions: Cannot connect to host 127.0.0.1:8002 ssl:default "
        f"[Connect call failed ('127.0.0.1', 8002)]; before: {a}; gone: http://10.1.2.3:80"
    )
    assert hide_backend_urls(state, message) == (
        "last: gpu-b/v1/completions: Cannot connect to host gpu-b ssl:default "
        f"[Connect call failed gpu-b]; before: {backend_public_id(a)}; "
        f"gone: {backend_public_id('http://10.1.2.3:80')}"
    )
    assert hide_backend_urls(state, "peer 10.0.0.9 reset") == "peer <address> reset"
