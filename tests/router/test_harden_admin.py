"""Issue 9, finding 14: the operator endpoints can leave the API port, need a key, and the
admin API adds backends only on allowed hosts.

With ``server.admin_port`` set, "/", "/metrics" and "/admin/..." answer on that port only
(404 on the API port, and the admin port answers 404 for the API); with
``server.metrics_auth`` "/" and "/metrics" need the admin key; with
``admin_allowed_backends`` an admin add outside the list gets 403. The split also holds
under ``--workers``, where the supervisor reserves the admin port for all workers.
"""

from __future__ import annotations

import http.client
import re
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.router.config import RouterConfig, ServerConfig
from kvroute.router.workers import WORKER_HEADER
from tests.router.conftest import Harness
from tests.router.test_harden_server import serving
from tests.router.test_workers import KVROUTE, start, stop

ADMIN = "admin-key-123"
KEY = {"Authorization": f"Bearer {ADMIN}"}
COMPLETION = {"model": "m1", "prompt": "x"}


async def _status(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> int:
    async with session.request(method, url, **kw) as resp:
        await resp.read()
        return resp.status


async def test_admin_listener_takes_the_operator_endpoints(harness: Harness) -> None:
    b = await harness.backend("b")
    async with (
        serving([b.url], admin_port=0, admin_key=ADMIN) as ls,
        aiohttp.ClientSession() as session,
    ):
        assert ls.admin is not None and ls.admin != ls.api
        api = f"http://{ls.api[0]}:{ls.api[1]}"
        ops = f"http://{ls.admin[0]}:{ls.admin[1]}"
        for path in ("/", "/metrics", "/admin/backends", "/admin/kv"):
            assert await _status(session, "GET", api + path, headers=KEY) == 404, path
            assert await _status(session, "GET", ops + path, headers=KEY) == 200, path
        assert await _status(session, "POST", api + "/v1/completions", json=COMPLETION) == 200
        assert await _status(session, "POST", ops + "/v1/completions", json=COMPLETION) == 404
        assert await _status(session, "GET", ops + "/v1/models") == 404
        assert await _status(session, "GET", api + "/health") == 200
        assert await _status(session, "GET", ops + "/health") == 200
        async with session.get(ops + "/metrics") as resp:
            text = await resp.text()
        assert 'kvroute_client_connections{listener="admin"}' in text
        assert 'kvroute_client_connections{listener="api"}' in text


async def test_metrics_auth_needs_the_admin_key(harness: Harness) -> None:
    b = await harness.backend("b")
    client = await harness.router([b.url], admin_key=ADMIN, server=ServerConfig(metrics_auth=True))
    for path in ("/", "/metrics"):
        assert (await client.get(path)).status == 401, path
        assert (await client.get(path, headers={"Authorization": "Bearer nope-nope"})).status == 401
        assert (await client.get(path, headers=KEY)).status == 200, path
    assert (await client.get("/health")).status == 200
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    open_client = await harness.router([b.url])
    assert (await open_client.get("/metrics")).status == 200


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"server": ServerConfig(metrics_auth=True)}, "server.metrics_auth"),
        ({"server": ServerConfig(admin_port=8000)}, "server.admin_port"),
        ({"admin_allowed_backends": ("10.0.0.0/33",)}, "admin_allowed_backends"),
        ({"admin_allowed_backends": ("http://x",)}, "admin_allowed_backends"),
    ],
)
def test_bad_admin_settings_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        RouterConfig(**changes)


async def test_admin_add_outside_the_allow_list_is_403(harness: Harness) -> None:
    a = await harness.backend("a")
    b = await harness.backend("b")
    client = await harness.router(
        [a.url], admin_key=ADMIN, admin_allowed_backends=("127.0.0.0/8", "*.engines.test")
    )

    async def add(body: dict[str, Any]) -> int:
        resp = await client.post("/admin/backends", json=body, headers=KEY)
        if resp.status == 403:
            assert (await resp.json())["error"]["code"] == "forbidden"
        return resp.status

    assert await add({"url": "http://10.9.9.9:8000"}) == 403
    assert await add({"url": "http://engine.example.com:8000"}) == 403
    assert await add({"url": "http://127.0.0.1.nip.io:8000"}) == 403  # a name, not an IP
    assert await add({"url": "http://[::1]:8000"}) == 403  # IPv6 is not in 127.0.0.0/8
    assert await add({"url": b.url, "kv_events": "tcp://10.0.0.1:5557"}) == 403
    assert await add({"url": b.url, "kv_events": "ipc:///tmp/kv.sock"}) == 403
    assert len(harness.state(client).backends) == 1
    assert await add({"url": b.url}) == 201
    assert await add({"url": "http://gpu-7.engines.test:8000"}) == 201  # a glob match
    assert len(harness.state(client).backends) == 3


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=KEY)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader(WORKER_HEADER) or ""
    finally:
        conn.close()


def test_workers_share_the_admin_port_and_the_client_timeouts(tmp_path: Path) -> None:
    """``--workers 2 --admin-port 0``: the supervisor reserves one admin port for both;
    each worker splits the endpoints and cuts a silent client after --header-timeout."""
    cmd = [*KVROUTE, "serve", "--workers", "2", "--port", "0", "--admin-port", "0",
           "--admin-key", ADMIN, "--header-timeout", "0.5", "--drain-timeout", "2",
           "--backend", "http://127.0.0.1:9"]  # fmt: skip
    proc = start("router", cmd, tmp_path)
    try:
        (line,) = proc.wait_line_sync(r"listening on", 60)
        found = re.search(r":(\d+) .*admin on http://[\d.]+:(\d+)", line)
        assert found, line
        port, admin_port = int(found.group(1)), int(found.group(2))
        assert _get(port, "/metrics")[0] == 404
        workers = set()
        for _ in range(20):  # fresh connections: the kernel spreads them over both workers
            status, worker = _get(admin_port, "/metrics")
            assert status == 200
            workers.add(worker.split(":")[0])
        assert workers == {"0", "1"}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            t0 = time.monotonic()
            assert silent.recv(1024) == b"", "closed by the worker, nothing sent"
            assert time.monotonic() - t0 < 8
    finally:
        assert stop(proc) == 0
