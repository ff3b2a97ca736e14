"""The circuit breaker's state machine, time passed in."""

from __future__ import annotations

from kvroute.router.breaker import CircuitBreaker, CircuitState
from kvroute.router.config import BreakerConfig


def _half_open(successes: int = 2) -> CircuitBreaker:
    b = CircuitBreaker(
        BreakerConfig(failure_threshold=1, open_s=5.0, half_open_successes=successes)
    )
    b.record_failure(0.0)
    assert b.state is CircuitState.OPEN and not b.allows(4.9)
    assert b.allows(5.0) and b.state is CircuitState.HALF_OPEN
    return b


def test_half_open_lets_one_trial_through_at_a_time() -> None:
    b = _half_open(successes=2)
    assert b.begin_attempt()  # the trial
    assert not b.allows(6.0)  # nobody else while it runs
    assert not b.begin_attempt()  # a request already on its way is no second trial
    b.record_success()
    assert b.state is CircuitState.HALF_OPEN and b.allows(6.0)  # one more trial due
    assert b.begin_attempt()
    b.record_success()
    assert b.state is CircuitState.CLOSED
    assert not b.begin_attempt() and b.allows(6.0)  # closed: attempts are not trials


def test_a_trial_without_verdict_frees_the_circuit() -> None:
    b = _half_open()
    assert b.begin_attempt()
    assert b.end_attempt()  # the client went away before the first byte
    assert b.state is CircuitState.HALF_OPEN and b.allows(6.0)
    assert not b.end_attempt()


def test_a_failed_trial_reopens() -> None:
    b = _half_open()
    assert b.begin_attempt()
    b.record_failure(6.0)
    assert b.state is CircuitState.OPEN and not b.trial_in_flight
    assert not b.allows(10.9) and b.allows(11.0)


def test_closed_counts_consecutive_failures_only() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=5.0))
    for _ in range(2):
        b.record_failure(0.0)
    b.record_success()
    b.record_failure(0.0)
    assert b.state is CircuitState.CLOSED and b.failures == 1
