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
from kvroute.router.config import BackendConfig, backend_public_id, load_config, normalize_url
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


# review 2, finding 6: one engine under several spellings was several backends
@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("http://127.0.0.1:19101", "http://127.0.0.1:19101"),  # canonical: unchanged
        ("https://engine.internal:8443/v1", "https://engine.internal:8443/v1"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://gpu-a", "http://gpu-a"),
        (" http://a:8000/ ", "http://a:8000"),
        ("HTTP://127.0.0.1:19101", "http://127.0.0.1:19101"),
        ("http://Engine.Internal:8000", "http://engine.internal:8000"),
        ("http://127.0.0.1:19101/.", "http://127.0.0.1:19101"),
        ("http://127.0.0.1:19101/./", "http://127.0.0.1:19101"),
        ("http://127.0.0.1:19101//", "http://127.0.0.1:19101"),
        ("http://a:1/v1/./", "http://a:1/v1"),
        ("http://a:1/x/../v1", "http://a:1/v1"),
        ("http://127.0.0.1:019101", "http://127.0.0.1:19101"),
        ("http://127.0.0.1:", "http://127.0.0.1"),
        ("http://[::ffff:127.0.0.1]:19101", "http://127.0.0.1:19101"),
        ("http://[0:0:0:0:0:0:0:1]:8000", "http://[::1]:8000"),
        ("http://[FE80::1]:8000", "http://[fe80::1]:8000"),
        ("http://gpu-a:80/v1", "http://gpu-a/v1"),  # the scheme's default port
        ("https://gpu-a:443", "https://gpu-a"),
        ("https://gpu-a:80", "https://gpu-a:80"),
        ("http://gpu-a:443", "http://gpu-a:443"),
    ],
)
def test_backend_urls_are_canonical(given: str, canonical: str) -> None:
    assert normalize_url(given) == canonical
    assert BackendConfig(url=given).url == canonical


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"http://127.0.0.1:19101?token={SECRET}", "query string"),
        ("http://127.0.0.1:19101/?", "query string"),
        (f"http://127.0.0.1:19101#{SECRET}", "fragment"),
        ("http://127.0.0.1:99999", "port"),
        ("http://127.0.0.1:0x1f", "port"),
        ("http://127.0.0.1:0", "port"),
    ],
)
def test_query_fragment_and_bad_port_are_refused_without_echoing_them(
    url: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        BackendConfig(url=url)
    assert str(info.value).startswith("backend.url: ") and SECRET not in str(info.value)


def test_config_refuses_one_engine_under_two_spellings(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("backends:\n  - url: HTTP://127.0.0.1:19101\n  - url: http://127.0.0.1:19101\n")
    with pytest.raises(
        ValueError, match=r"^backends: duplicate backend URL http://127\.0\.0\.1:19101$"
    ):
        load_config(cfg)
    with pytest.raises(ValueError, match=r"^backends: duplicate backend URL"):
        load_config(backends=["http://127.0.0.1:19101/.", "http://[::ffff:127.0.0.1]:19101"])
    config = load_config(
        backends=["HTTP://127.0.0.1:19101/"], kv_events={"http://127.0.0.1:19101": "tcp://h:1"}
    )
    assert config.backends[0].url == "http://127.0.0.1:19101"
    assert config.backends[0].kv_events == "tcp://h:1"


async def test_admin_api_finds_one_engine_under_every_spelling(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url], admin_key=ADMIN)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    port = a.url.rsplit(":", 1)[1]
    for url in (
        a.url.replace("http://", "HTTP://"),
        a.url + "/.",
        a.url.replace(f":{port}", f":0{port}"),
        a.url.replace("127.0.0.1", "[::ffff:127.0.0.1]"),
    ):
        resp = await client.post("/admin/backends", json={"url": url}, headers=auth)
        assert resp.status == 400, url
        assert f"backend {a.url} is already present" in (await resp.text())
    for url in (a.url + "?x=1", a.url + "#f"):
        resp = await client.post("/admin/backends", json={"url": url}, headers=auth)
        assert resp.status == 400 and "backend.url" in (await resp.text())
    drained = {"url": a.url.replace("http://", "HTTP://") + "/", "draining": True}
    resp = await client.post("/admin/backends/drain", json=drained, headers=auth)
    assert resp.status == 200 and (await resp.json())["url"] == a.url
    resp = await client.delete(f"/admin/backends?url={a.url}/.", headers=auth)
    assert resp.status == 200 and (await resp.json()) == {"removed": a.url}
