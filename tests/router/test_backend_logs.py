"""An operator learns from the log why a backend takes no traffic (a new user's review,
fifteenth session): a backend down since it was added, or given as an OpenAI base URL
("/v1", whose /health answers 404), and a circuit that opens were never logged; every
request just got 503 "no healthy backend"."""

from __future__ import annotations

import logging

import pytest

from kvroute.router.config import BreakerConfig
from kvroute.router.health import probe
from tests.conftest import until
from tests.router.conftest import Harness
from tests.router.harden_request_helpers import dead_url

BODY = b'{"model": "m1", "prompt": "x"}'


async def test_a_backend_given_with_v1_is_logged_with_the_reason_and_a_hint(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute.router.health")
    b = await harness.backend("a")
    client = await harness.router([b.url + "/v1"])
    assert (await client.post("/v1/completions", data=BODY)).status == 503
    await until(lambda: "not healthy yet" in caplog.text, 5.0)
    assert "/health answered 404" in caplog.text
    assert "without /v1" in caplog.text


async def test_a_dead_backend_is_logged_once(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute.router.health")
    b = await harness.backend("a")
    dead = dead_url()
    client = await harness.router([b.url, dead])
    await until(lambda: f"backend {dead} is not healthy yet" in caplog.text, 5.0)
    assert "without /v1" not in caplog.text
    assert (await client.post("/v1/completions", data=BODY)).status == 200
    state = harness.state(client)
    rt = state.backends.get(dead)
    assert rt is not None
    await probe(state, rt)  # a second failed round: no second line
    assert caplog.text.count(f"backend {dead} is not healthy yet") == 1


async def test_an_opening_circuit_is_logged_with_the_last_error(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute.router.backends")
    good, bad = await harness.backend("good"), await harness.backend("bad")
    bad.state.fail_status = 503
    client = await harness.router(
        [bad.url, good.url], breaker=BreakerConfig(failure_threshold=2, open_s=10.0)
    )
    for _ in range(6):
        assert (await client.post("/v1/completions", data=BODY)).status == 200
    assert f"backend {bad.url}: circuit open" in caplog.text
    assert "503" in caplog.text
