"""Session hints: headers, the body's ``user``, their config, metrics and bounds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.core.policy.base import RouteRequest
from kvroute.router.cli import add_parser, config_from_args
from kvroute.router.config import SessionConfig, load_config
from kvroute.router.state import RouterState
from tests.core.test_reuse_regime import replay
from tests.router.conftest import Harness

BODY = {"model": "m1", "prompt": "hello", "max_tokens": 4}


def _home(state: RouterState, session: str, model: str = "m1") -> str | None:
    """The backend the router recorded for ``session`` on ``model``."""
    probe = RouteRequest("probe", model, [], 1, 1, session=session)
    return state.fleet.session_backend(probe, state.clock())


def _sample(state: RouterState, name: str, labels: dict[str, str] | None = None) -> float | None:
    return state.metrics.registry.get_sample_value(name, labels or {})


def _results(state: RouterState) -> dict[str, float | None]:
    name = "kvroute_session_requests_total"
    return {r: _sample(state, name, {"result": r}) for r in ("new", "home", "moved")}


async def test_a_session_header_records_the_home_and_counts_where_each_turn_went(
    harness: Harness,
) -> None:
    a, b = await harness.backend("a"), await harness.backend("b")
    client = await harness.router([a.url, b.url])  # round robin: every turn moves
    state = harness.state(client)
    assert _results(state) == {"new": 0.0, "home": 0.0, "moved": 0.0}
    backends = []
    for _ in range(3):
        resp = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "s-1"})
        assert resp.status == 200
        backends.append(resp.headers["x-kvroute-backend"])
    assert _home(state, "s-1") == backends[-1]
    assert _results(state) == {"new": 1.0, "home": 0.0, "moved": 2.0}
    assert _sample(state, "kvroute_sessions_tracked") == 1.0
    text = await (await client.get("/metrics")).text()
    assert "kvroute_sessions_tracked 1.0" in text
    assert 'kvroute_session_requests_total{result="moved"} 2.0' in text
    # without a hint nothing is counted or recorded
    await client.post("/v1/completions", json=BODY)
    assert _results(state)["new"] == 1.0 and _sample(state, "kvroute_sessions_tracked") == 1.0


async def test_the_first_header_present_wins_then_the_user_field(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url])
    state = harness.state(client)
    headers = {"x-claude-code-session-id": "late", "x-session-affinity": "first"}
    await client.post("/v1/completions", json=BODY, headers=headers)
    assert _home(state, "first") == a.url and _home(state, "late") is None
    await client.post("/v1/completions", json=BODY, headers={"session_id": "under_score"})
    assert _home(state, "under_score") == a.url
    await client.post("/v1/completions", json={**BODY, "user": "alice"})
    assert _home(state, "alice") == a.url
    await client.post("/v1/completions", json={**BODY, "user": 42})  # not a string: no hint
    await client.post("/v1/completions", json=BODY, headers={"x-session-id": "h"})
    assert _sample(state, "kvroute_sessions_tracked") == 4.0  # first, under_score, alice, h


async def test_bad_hints_are_ignored_not_refused(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url])
    state = harness.state(client)
    too_long = "x" * 257
    resp = await client.post("/v1/completions", json=BODY, headers={"x-session-id": too_long})
    assert resp.status == 200
    resp = await client.post("/v1/completions", json={**BODY, "user": "a\x01b"})
    assert resp.status == 200
    resp = await client.post("/v1/completions", json={**BODY, "user": ""})
    assert resp.status == 200
    assert _sample(state, "kvroute_sessions_tracked") == 0.0
    # an unusable header falls through to the next source
    body = {**BODY, "user": "bob"}
    await client.post("/v1/completions", json=body, headers={"x-session-id": too_long})
    assert _home(state, "bob") == a.url
    resp = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "x" * 256})
    assert _home(state, "x" * 256) == a.url


async def test_one_session_id_on_two_models_is_two_sessions(harness: Harness) -> None:
    a = await harness.backend("a", model="m1")
    c = await harness.backend("c", model="m2")
    client = await harness.router([a.url, c.url])
    state = harness.state(client)
    for model in ("m1", "m2"):
        body = {**BODY, "model": model}
        resp = await client.post("/v1/completions", json=body, headers={"x-session-id": "s"})
        assert resp.status == 200
    assert (_home(state, "s", "m1"), _home(state, "s", "m2")) == (a.url, c.url)
    assert _results(state)["new"] == 2.0


async def test_configured_headers_and_switching_hints_off(harness: Harness) -> None:
    a = await harness.backend("a")
    sessions = SessionConfig(headers=("X-Conversation",), use_user_field=False, ttl_s=30)
    client = await harness.router([a.url], sessions=sessions)
    state = harness.state(client)
    assert state.fleet.config.session_ttl_s == 30
    await client.post("/v1/completions", json={**BODY, "user": "u"}, headers={"x-session-id": "d"})
    assert _sample(state, "kvroute_sessions_tracked") == 0.0
    await client.post("/v1/completions", json=BODY, headers={"x-conversation": "c"})
    assert _home(state, "c") == a.url
    off = await harness.router([a.url], sessions=SessionConfig(headers=(), use_user_field=False))
    await off.post("/v1/completions", json={**BODY, "user": "u"}, headers={"x-session-id": "d"})
    assert _sample(harness.state(off), "kvroute_sessions_tracked") == 0.0
    assert _results(harness.state(off))["new"] == 0.0


def test_sessions_yaml_section_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "sessions: {headers: [X-Conv, x-session-id], use_user_field: false, "
        "ttl_s: 60, max_entries: 500}\n"
    )
    cfg = load_config(path, backends=["http://a:1"])
    assert cfg.sessions == SessionConfig(("x-conv", "x-session-id"), False, 60.0, 500)
    assert load_config(None).sessions.headers == (
        "x-session-affinity",
        "x-session-id",
        "session_id",
        "x-claude-code-session-id",
    )
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    base = ["serve", "--backend", "http://h:1", "--config", str(path)]
    flags = parser.parse_args([*base, "--session-header", "X-A", "--session-header", "x-b"])
    assert config_from_args(flags).sessions.headers == ("x-a", "x-b")
    assert config_from_args(flags).sessions.ttl_s == 60  # the rest of the file stays
    off = config_from_args(parser.parse_args([*base, "--no-session-hints"])).sessions
    assert (off.headers, off.use_user_field) == ((), False)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("sessions: {ttl_s: 0}", "sessions.ttl_s"),
        ("sessions: {max_entries: 0}", "sessions.max_entries"),
        ("sessions: {headers: x-session-id}", "sessions.headers"),
        ("sessions: {headers: ['bad header']}", "sessions.headers"),
        ("sessions: {headers: ['']}", "sessions.headers"),
        ("sessions: {use_user_field: 1}", "sessions.use_user_field"),
        ("sessions: {header: [a]}", "sessions"),
        ("sessions: [a]", "sessions"),
    ],
)
def test_bad_session_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{field}"):
        load_config(path)


async def test_metrics_say_where_the_fleets_reuse_falls(harness: Harness) -> None:
    a = await harness.backend("a")
    client = await harness.router([a.url])
    state = harness.state(client)
    text = await (await client.get("/metrics")).text()
    assert "kvroute_reuse_regime 0.0" in text  # nothing seen yet: no verdict
    reuse = replay(distance=700, steps=400, into=state.fleet.reuse)  # just inside
    text = await (await client.get("/metrics")).text()
    assert "kvroute_reuse_regime 1.0" in text
    assert _sample(state, "kvroute_reuse_late_requests") == reuse.late > 0
    assert _sample(state, "kvroute_reuse_ghost_requests") == 0.0
