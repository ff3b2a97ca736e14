"""Numbers a client sends cannot leave load behind (issue 9, finding 1), over real HTTP.

``max_tokens`` beyond a sane cap or the model's context gets a 400 in the OpenAI error
shape, and the router keeps routing to every backend.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvroute.router.config import BackendConfig
from kvroute.router.errors import BadRequest
from kvroute.router.metrics import BackendCollector
from kvroute.router.request import ParsedRequest, parse_completion
from tests.router.conftest import Harness, assert_no_load
from tests.router.harden_request_helpers import (
    OK_BODY,
    assert_bad_request,
    dead_url,
)

# -- finding 1: numbers that overflowed the load arithmetic -----------------------------


async def test_huge_max_tokens_never_takes_a_backend_out_of_routing(harness: Harness) -> None:
    """8 concurrent max_tokens=10**308 once leaked their tickets (OverflowError after the
    load was taken): one backend was never chosen again and /metrics answered 500."""
    b1, b2 = await harness.backend("b1"), await harness.backend("b2")
    client = await harness.router([b1.url, b2.url], policy="least_load")
    chat = {"model": "m1", "messages": [{"role": "user", "content": "p"}]}
    huge = [
        (path, {**body, "user": f"p{i}", field: 10**308})
        for i in range(8)
        for path, body, field in (
            ("/v1/completions", OK_BODY, "max_tokens"),
            ("/v1/chat/completions", chat, "max_tokens"),
            ("/v1/chat/completions", chat, "max_completion_tokens"),
        )
    ]
    resps = await asyncio.gather(*(client.post(path, json=b) for path, b in huge))
    for resp in resps:
        await assert_bad_request(resp, "at most")
    assert not b1.state.requests and not b2.state.requests
    state = harness.state(client)
    assert_no_load(state)
    assert (await client.get("/metrics")).status == 200
    # least_load spreads concurrent requests only if no backend carries phantom load
    for b in (b1, b2):
        b.state.stall_s = 0.2
    bodies = [{**OK_BODY, "prompt": f"q{i}", "max_tokens": 8} for i in range(8)]
    resps = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    assert [r.status for r in resps] == [200] * 8
    assert len(b1.state.requests) == len(b2.state.requests) == 4
    assert_no_load(state)


async def test_max_tokens_above_the_models_context_is_refused(harness: Harness) -> None:
    """A backend's /v1/models card says max_model_len: a larger max_tokens fits nowhere.
    (The proxy calls ``Backends.check_context`` after it resolved the model.)"""
    b = await harness.backend("a")
    b.state.max_model_len = 4096
    client = await harness.router([b.url])
    backends = harness.state(client).backends
    assert backends.max_model_len("m1") == 4096  # read from the live card
    assert backends.max_model_len("other") is None  # no backend lists it

    def parsed(max_tokens: int) -> ParsedRequest:
        return parse_completion(
            json.dumps({**OK_BODY, "max_tokens": max_tokens}).encode(), chat=False
        )

    backends.check_context("m1", parsed(4096))
    with pytest.raises(BadRequest, match="4096"):
        backends.check_context("m1", parsed(4097))
    backends.check_context("other", parsed(100_000))
    defaulted = parse_completion(json.dumps(OK_BODY).encode(), chat=False)  # 16 tokens
    backends.set_models(b.url, [{"id": "m1", "max_model_len": 8}])  # as the next probe would
    assert backends.max_model_len("m1") == 8
    backends.check_context("m1", defaulted)  # the router's own default is never refused
    backends.add(BackendConfig(url=dead_url()))  # its models unknown: it might serve more
    assert backends.max_model_len("m1") is None
    backends.check_context("m1", parsed(100_000))


def test_one_odd_gauge_value_does_not_break_the_metrics_page() -> None:
    rows = [
        {"url": "http://a", "kvroute_backend_in_flight_tokens": 10**400},
        {"url": "http://b", "kvroute_backend_in_flight_tokens": 7, "kvroute_backend_healthy": "x"},
    ]
    registry = CollectorRegistry()
    registry.register(BackendCollector(lambda: rows))
    page = generate_latest(registry).decode()
    assert 'kvroute_backend_in_flight_tokens{backend="http://b"} 7.0' in page
    assert 'backend="http://a"' not in page


async def test_the_proxy_refuses_what_fits_no_context_and_honours_the_name_limit(
    harness: Harness,
) -> None:
    """Over HTTP: the context check runs on the request path, and the configured
    ``limits.max_model_name_chars`` is the one the parser uses."""
    from kvroute.router.config import LimitConfig

    b = await harness.backend("a")
    b.state.max_model_len = 4096
    client = await harness.router([b.url], limits=LimitConfig(max_model_name_chars=8))
    resp = await client.post("/v1/completions", json={**OK_BODY, "max_tokens": 4097})
    await assert_bad_request(resp, "4096")
    resp = await client.post("/v1/completions", json={**OK_BODY, "model": "m" * 9})
    await assert_bad_request(resp, "8")
    assert not b.state.requests
    resp = await client.post("/v1/completions", json={**OK_BODY, "max_tokens": 8})
    assert resp.status == 200
    assert_no_load(harness.state(client))
