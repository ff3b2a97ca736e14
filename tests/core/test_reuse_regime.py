"""The fleet's reuse regime: reuse just inside the caches' residency, or just past it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.policy.base import Decision
from kvroute.core.reuse_regime import SAMPLES_PER_TURNOVER, ReuseRegime
from tests.core.routing_helpers import chain, make_fleet, req, url

CAP = 1000  # blocks in the whole fleet's caches


def replay(
    distance: int,
    steps: int,
    capacity: int = CAP,
    *,
    into: ReuseRegime | None = None,
    back: Sequence[tuple[int, Callable[[int], bool]]] = (),
) -> ReuseRegime:
    """A new prompt of 10 blocks at every step, and the one ``distance`` blocks older
    coming back (adding nothing); ``back``: instead, (distance, which prompts) pairs."""
    r = into if into is not None else ReuseRegime()
    returns = back or ((distance, lambda j: True),)
    for i in range(steps):
        r.observe(list(range(10 * i, 10 * i + 10)), 10, capacity)
        for d, which in returns:
            j = i - d // 10
            if j >= 0 and which(j):
                r.observe(list(range(10 * j, 10 * j + 10)), 0, capacity)
    return r


def test_reuse_just_inside_the_residency_is_concave():
    r = replay(distance=700, steps=400)
    assert r.late > 0 and r.ghost == 0
    assert r.concave is True


def test_reuse_just_past_the_residency_is_convex():
    r = replay(distance=1200, steps=400)
    assert r.ghost > 0 and r.late == 0
    assert r.concave is False


def test_reuse_far_inside_or_far_past_says_nothing():
    assert replay(distance=200, steps=400).concave is None  # everything fits
    assert replay(distance=3000, steps=600).concave is None  # nothing comes back in time


def test_a_few_requests_give_no_verdict_however_many_blocks_they_have():
    r = ReuseRegime()
    long = list(range(1, 401))  # one request of 400 blocks, back at 700 blocks
    r.observe(long, 400, CAP)
    r.observe(list(range(1000, 1300)), 300, CAP)
    r.observe(long, 0, CAP)
    assert r.late == 1.0 and r.concave is None  # 400 blocks, one request: one vote


def test_balanced_sides_give_no_verdict():
    # even prompts come back just inside, odd ones just past
    r = replay(0, 600, back=((700, lambda j: j % 2 == 0), (1210, lambda j: j % 2 == 1)))
    assert r.late + r.ghost > 16 and r.late > 0 and r.ghost > 0
    assert r.concave is None


def test_large_fleets_sample_every_stride_th_block():
    cap = SAMPLES_PER_TURNOVER * 8
    steps = int(cap * 0.7) // 10 + 50
    r = replay(distance=int(cap * 0.7), steps=steps, capacity=cap)
    assert r.stride == 8
    assert len(r._current) + len(r._previous) == steps  # the 8th block of each prompt
    assert r.late > 0 and r.ghost == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), max_size=200))
def test_memory_stays_within_what_three_turnovers_add(steps):
    # a prompt: (first key, length) chains; a known prompt adds nothing
    r = ReuseRegime()
    cap = 200
    seen: set[int] = set()
    for first, n in steps:
        keys = [first * 1000 + i for i in range(n)]
        added = sum(1 for k in keys if k not in seen)
        seen.update(keys)
        r.observe(keys, added, cap)
        entries = len(r._current) + len(r._previous)
        assert entries <= 3 * cap + 2 * 40 + len(keys)


def test_a_small_lead_gives_no_verdict_however_long_the_run():
    # 11 of every 20 prompts come back just inside, 9 just past
    inside, past = (lambda j: j % 20 < 11), (lambda j: j % 20 >= 11)
    r = replay(0, 3000, back=((700, inside), (1210, past)))
    assert r.late + r.ghost > 200 and r.late > r.ghost > 0
    assert r.concave is None


def test_the_fleet_learns_the_regime_from_its_dispatches_and_shows_it_to_the_policy():
    seen: list[bool] = []
    # a new prompt of 7 blocks after a shared one, and the one ``lag`` steps older back on
    # another backend (7 blocks added again): 14 added a step, so 196 / 280 blocks later
    for lag, verdict in ((14, True), (20, False)):
        fleet = make_fleet(n=4, capacity=64)  # 256 blocks in all: late [128, 256)
        assert fleet.index.total_capacity_blocks == 256
        prompts = [chain((1, 1), (1000 + i, 7)) for i in range(200)]
        for i in range(len(prompts)):
            for j, shift in ((i, 0), (i - lag, 1)):
                if j < 0:
                    continue
                to = url((j + shift) % 4)
                t = fleet.dispatch(Decision(to, "t", 0, (to,)), req(f"{i}:{j}", prompts[j]), i)
                fleet.finish(t, float(i), True)
        assert fleet.reuse.concave is verdict
        real = fleet.policy.choose

        def choose(r, view, now, real=real):  # what the policy is shown
            seen.append(view.reuse_concave)
            return real(r, view, now)

        fleet.policy.choose = choose  # type: ignore[method-assign]
        fleet.route(req("probe", chain((2, 8))), 300.0)
    assert seen == [True, False]
