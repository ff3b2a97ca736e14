"""The prefix policy's session hint: a tie-breaker toward the session's last backend."""

from __future__ import annotations

import dataclasses

from kvroute.core.policy import Decision, RouteRequest
from tests.core.routing_helpers import chain, make_fleet, req, serve, url

HARNESS = chain((1, 64))  # a 1,024-token harness prompt every session shares


def turn(session: str, i: int, *, fresh: int, prompt_tokens: int | None = None) -> RouteRequest:
    """The harness, then blocks no earlier turn sent (a compacted context: only the harness
    matches anything cached)."""
    r = req(f"{session}-{i}", HARNESS + chain((fresh, 2)), prompt_tokens=prompt_tokens)
    return dataclasses.replace(r, session=session)


def harness_everywhere(fleet, n: int) -> None:
    for i in range(n):
        u = url(i)
        t = fleet.dispatch(Decision(u, "test", 0, (u,)), req(f"h{i}", HARNESS), 0.0)
        fleet.finish(t, 0.0, True)


def test_two_sessions_keep_their_backends_while_a_hot_third_spreads():
    fleet = make_fleet(n=6)
    harness_everywhere(fleet, 6)
    homes: dict[str, set[str]] = {"a": set(), "b": set(), "hot": set()}
    reasons: dict[str, list[str]] = {"a": [], "b": []}
    now, fresh, open_hot = 1.0, 1000, []
    for i in range(20):
        for s in ("a", "b"):
            now += 0.01
            fresh += 1
            d, t = serve(fleet, turn(s, i, fresh=fresh), now)
            homes[s].add(d.backend)
            reasons[s].append(d.reason)
            fleet.on_first_token(t, now + 0.005)
            fleet.finish(t, now + 0.01, True)
        for _ in range(3):  # the hot session: long new work, none of it finishes
            now += 0.001
            fresh += 1
            d, t = serve(fleet, turn("hot", i, fresh=fresh, prompt_tokens=6_000), now)
            homes["hot"].add(d.backend)
            open_hot.append(t)
    assert len(homes["a"]) == 1 and len(homes["b"]) == 1
    assert "session" in reasons["a"] and "session" in reasons["b"]
    assert len(homes["hot"]) >= 2  # its load spread it over the fleet
    for t in open_hot:
        fleet.finish(t, now, True)
    fleet.check_invariants()


def test_without_the_hint_ties_follow_load_and_sessions_wander():
    """The control for the test above: the same turns with no session scatter."""
    fleet = make_fleet(n=6)
    harness_everywhere(fleet, 6)
    used, now, fresh = set(), 1.0, 1000
    for i in range(20):
        now += 0.01
        fresh += 1
        r = dataclasses.replace(turn("a", i, fresh=fresh), session=None)
        d, t = serve(fleet, r, now)
        used.add(d.backend)
        assert d.reason == "prefix"
        # someone else's request keeps that backend busy a while
        fleet.dispatch(
            Decision(d.backend, "test", 0, (d.backend,)), req(f"x{i}", chain((9000 + i, 8))), now
        )
        fleet.finish(t, now + 0.01, True)
    assert len(used) > 1


def test_the_hint_never_sends_to_a_dead_or_draining_backend():
    fleet = make_fleet(n=3)
    harness_everywhere(fleet, 3)
    d, t = serve(fleet, turn("a", 0, fresh=500), 1.0)
    fleet.finish(t, 1.1, True)
    home = d.backend
    fleet.set_healthy(home, False)
    d2, t2 = serve(fleet, turn("a", 1, fresh=501), 2.0)
    assert d2.backend != home and d2.reason != "session"
    fleet.finish(t2, 2.1, True)
    fleet.set_healthy(home, True)
    fleet.set_draining(d2.backend, True)
    d3, _ = serve(fleet, turn("a", 2, fresh=502), 3.0)
    assert d3.backend != d2.backend


def test_the_hint_does_not_outrank_a_deeper_match_elsewhere():
    fleet = make_fleet(n=3)
    harness_everywhere(fleet, 3)
    context = HARNESS + chain((7, 32))  # the session's own context, 512 tokens
    first = dataclasses.replace(req("s0", context), session="s")
    d, t = serve(fleet, first, 1.0)
    fleet.finish(t, 1.1, True)
    # the same context reaches another backend under another session
    other = next(url(i) for i in range(3) if url(i) != d.backend)
    t = fleet.dispatch(Decision(other, "test", 0, (other,)), req("x", context + chain((8, 8))), 1.2)
    fleet.finish(t, 1.3, True)
    longer = dataclasses.replace(req("s1", context + chain((8, 8), (9, 1))), session="s")
    d2, _ = serve(fleet, longer, 2.0)
    assert d2.backend == other and d2.reason == "prefix"
