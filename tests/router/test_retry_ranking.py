"""Retries walk the first decision's ranking; the TTFT estimate is checked against the
observed first token (kvroute_ttft_prediction_error_seconds).

Real HTTP on loopback: a router in front of fake backends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision, FleetView, RouteRequest
from kvroute.core.policy.round_robin import RoundRobinPolicy
from kvroute.router.state import RouterState
from tests.conftest import until
from tests.router.conftest import Harness

BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 4}'
STREAM = b'{"model": "m1", "prompt": "hello", "max_tokens": 4, "stream": true}'
ERROR = "kvroute_ttft_prediction_error_seconds"
PREDICTED = "kvroute_ttft_predicted_seconds_total"
OBSERVED = "kvroute_ttft_observed_seconds_total"


class _Dispatches:
    """A FleetListener that keeps every dispatched decision, in order."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def on_dispatch(
        self, ticket: Ticket, decision: Decision, req: RouteRequest, now: float
    ) -> None:
        self.decisions.append(decision)

    def on_first_token(self, ticket: Ticket, now: float, cached_tokens: int | None) -> None:
        pass

    def on_cached_tokens(self, ticket: Ticket, cached_tokens: int) -> None:
        pass

    def on_finish(self, ticket: Ticket, now: float, ok: bool) -> None:
        pass


def _listen(state: RouterState) -> _Dispatches:
    listener = _Dispatches()
    state.fleet.listeners.append(listener)
    return listener


def _retries(state: RouterState, url: str, cause: str) -> float:
    labels = {"backend": url, "cause": cause}
    return state.metrics.registry.get_sample_value("kvroute_retries_total", labels) or 0.0


async def test_a_503_goes_to_the_second_ranked_backend(harness: Harness) -> None:
    """Round robin over a < b < c ranks (a, b, c) for the first request. Routing again
    without a would move the cursor and pick c; walking the ranking gives b, and the
    cursor moved once, so the next request starts at b."""
    fakes = [await harness.backend(name) for name in ("x", "y", "z")]
    a, b, c = sorted(fakes, key=lambda f: f.url)
    a.state.fail_status = 503
    client = await harness.router([f.url for f in fakes])
    state = harness.state(client)
    seen = _listen(state)

    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert resp.headers["x-kvroute-backend"] == b.url
    assert resp.headers["x-kvroute-decision"] == "retry"
    first, retry = seen.decisions
    assert first.ranked == (a.url, b.url, c.url)
    assert retry == first.moved_to(b.url)
    assert (len(a.state.requests), len(b.state.requests), len(c.state.requests)) == (1, 1, 0)
    assert _retries(state, a.url, "503") == 1

    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert resp.headers["x-kvroute-backend"] == b.url
    assert resp.headers["x-kvroute-decision"] == "round_robin"


async def test_a_connect_error_walks_the_ranking_too(harness: Harness) -> None:
    """A refused connection delivered nothing: the walk goes on past it to the third."""
    fakes = [await harness.backend(name) for name in ("x", "y", "z")]
    a, b, c = sorted(fakes, key=lambda f: f.url)
    b.state.fail_status = 503
    client = await harness.router([f.url for f in fakes])
    state = harness.state(client)
    await a.close()  # healthy at start, refusing connections now
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert resp.headers["x-kvroute-backend"] == c.url
    assert resp.headers["x-kvroute-decision"] == "retry"
    assert _retries(state, a.url, "connect") == 1
    assert _retries(state, b.url, "503") == 1


async def test_the_walk_skips_a_ranked_backend_that_became_ineligible(harness: Harness) -> None:
    """b is drained while a is failing the request: the retry skips b for c."""
    fakes = [await harness.backend(name) for name in ("x", "y", "z")]
    a, b, c = sorted(fakes, key=lambda f: f.url)
    a.state.fail_status = 503
    a.state.stall_s = 0.3
    client = await harness.router([f.url for f in fakes])
    state = harness.state(client)
    seen = _listen(state)

    async def send() -> tuple[int, str]:
        resp = await client.post("/v1/completions", data=BODY)
        await resp.read()
        return resp.status, resp.headers["x-kvroute-backend"]

    sent = asyncio.create_task(send())
    await until(lambda: len(a.state.requests) == 1)
    state.backends.set_draining(b.url, True)
    assert await sent == (200, c.url)
    assert seen.decisions[0].ranked == (a.url, b.url, c.url)
    assert len(b.state.requests) == 0


class _TopOnly(RoundRobinPolicy):
    """Round robin whose ranking names its pick alone (as a capped ranking in a fleet
    bigger than the cap runs out); records what each call excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.excluded: list[frozenset[str]] = []

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        self.excluded.append(view.excluded)
        decision = super().choose(request, view, now)
        if decision is None:
            return None
        return Decision(decision.backend, decision.reason, 0, (decision.backend,))


async def test_an_exhausted_ranking_routes_again_without_the_tried(harness: Harness) -> None:
    fakes = [await harness.backend(name) for name in ("x", "y")]
    a, b = sorted(fakes, key=lambda f: f.url)
    a.state.fail_status = 503
    client = await harness.router([f.url for f in fakes])
    policy = harness.state(client).fleet.policy = _TopOnly()
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200
    assert resp.headers["x-kvroute-backend"] == b.url
    assert resp.headers["x-kvroute-decision"] == "retry"
    assert policy.excluded == [frozenset(), frozenset({a.url})]


async def test_a_body_still_reaches_at_most_two_backends(harness: Harness) -> None:
    fakes = [await harness.backend(name) for name in ("x", "y", "z")]
    for f in fakes:
        f.state.fail_status = 503
    client = await harness.router([f.url for f in fakes])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 503  # they cannot take work: the client should come back later
    assert resp.headers["Retry-After"] == "1"
    error = (await resp.json())["error"]
    assert "2 backends tried" in error["message"] and error["code"] == "backend_unavailable"
    assert sum(len(f.state.requests) for f in fakes) == 2


@pytest.mark.parametrize(("sent", "passed"), [("7", "7"), ("soon", "1"), ("9" * 9, "1")])
async def test_the_engines_retry_after_reaches_the_client(
    harness: Harness, sent: str, passed: str
) -> None:
    fakes = [await harness.backend(name) for name in ("x", "y")]
    for f in fakes:
        f.state.fail_status, f.state.fail_retry_after = 503, sent
    client = await harness.router([f.url for f in fakes])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == passed  # seconds as the engine said, if sane


def _samples(state: RouterState, name: str, urls: Sequence[str]) -> dict[str, float]:
    registry = state.metrics.registry
    return {u: registry.get_sample_value(name, {"backend": u}) or 0.0 for u in urls}


async def test_ttft_prediction_error_per_backend(harness: Harness) -> None:
    """Each stream's first token is compared with the estimate its decision carried:
    one error sample per stream, the predicted sum is the decisions' estimates, the
    observed sum lies between the engine's delay and the wall time, and each sample's
    bucket says how far off the estimate was."""
    fakes = [await harness.backend(name) for name in ("x", "y")]
    delay_s = 0.05
    for f in fakes:
        f.state.chunk_delay_s = delay_s
    client = await harness.router([f.url for f in fakes], policy="prefix")
    state = harness.state(client)
    seen = _listen(state)
    urls = [f.url for f in fakes]
    n = 4
    started = time.monotonic()
    for i in range(n):
        body = b'{"model": "m1", "prompt": "question %d", "max_tokens": 4, "stream": true}' % i
        resp = await client.post("/v1/completions", data=body)
        assert resp.status == 200
        await resp.read()
    wall_s = time.monotonic() - started
    # a whole answer has no first token: nothing to compare
    assert (await client.post("/v1/completions", data=BODY)).status == 200

    counts = _samples(state, ERROR + "_count", urls)
    predicted = _samples(state, PREDICTED, urls)
    observed = _samples(state, OBSERVED, urls)
    assert sum(counts.values()) == n
    estimates: dict[str, float] = dict.fromkeys(urls, 0.0)
    for d in seen.decisions[:n]:
        assert d.ttft_estimate_s is not None and d.ttft_estimate_s > 0
        estimates[d.backend] += d.ttft_estimate_s
    for url in urls:
        assert predicted[url] == pytest.approx(estimates[url])
    assert n * delay_s <= sum(observed.values()) <= wall_s
    # every sample is observed - predicted: within (-max estimate, wall time]
    registry = state.metrics.registry
    for url in urls:
        le = {"backend": url}
        below = registry.get_sample_value(ERROR + "_bucket", {**le, "le": "-30.0"}) or 0.0
        within = registry.get_sample_value(ERROR + "_bucket", {**le, "le": "30.0"}) or 0.0
        assert (below, within) == (0.0, counts[url])
    busy = max(urls, key=lambda u: counts[u])
    state.metrics.forget(busy)  # a removed backend's series go with it
    assert registry.get_sample_value(ERROR + "_count", {"backend": busy}) is None
    assert registry.get_sample_value(OBSERVED, {"backend": busy}) is None


async def test_no_estimate_no_prediction_error(harness: Harness) -> None:
    """Round robin estimates nothing: its first tokens add no sample."""
    a = await harness.backend("a")
    client = await harness.router([a.url])
    resp = await client.post("/v1/completions", data=STREAM)
    await resp.read()
    state = harness.state(client)
    assert _samples(state, ERROR + "_count", [a.url])[a.url] == 0.0
    assert _samples(state, PREDICTED, [a.url])[a.url] == 0.0
    assert _samples(state, OBSERVED, [a.url])[a.url] == 0.0
