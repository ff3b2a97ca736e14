"""Per-backend circuit breaker: closed -> open -> half-open -> closed.

Passive failures (connect error, 5xx, timeout before the first byte) count; a success
resets the count. After ``failure_threshold`` consecutive failures the circuit opens and
the backend takes no traffic for ``open_s``; then it is half-open: one trial request at a
time (``begin_attempt`` .. its verdict or ``end_attempt``), so a backend that has just
come back is not flooded by every request that prefers it; one failure re-opens it,
``half_open_successes`` successes close it. Time is an argument.
"""

from __future__ import annotations

import enum

from kvroute.router.config import BreakerConfig


class CircuitState(enum.IntEnum):
    """Exported as a gauge value: 0 closed, 1 half-open, 2 open."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """State machine only; the owner tells the Fleet when ``allows`` changes."""

    __slots__ = ("_config", "_opened_at", "_successes", "failures", "state", "trial_in_flight")

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self.state = CircuitState.CLOSED
        self.failures = 0  # consecutive failures while closed
        self._successes = 0  # trial successes while half-open
        self._opened_at = 0.0
        self.trial_in_flight = False  # half-open: a trial request awaits its verdict

    def allows(self, now: float) -> bool:
        """Whether the backend may take requests; moves open -> half-open when due."""
        if self.state is CircuitState.OPEN and now - self._opened_at >= self._config.open_s:
            self.state = CircuitState.HALF_OPEN
            self._successes = 0
        if self.state is CircuitState.HALF_OPEN:
            return not self.trial_in_flight
        return self.state is CircuitState.CLOSED

    def begin_attempt(self) -> bool:
        """A request was sent; True when it is the half-open trial (allows() turns False)."""
        if self.state is not CircuitState.HALF_OPEN or self.trial_in_flight:
            return False
        self.trial_in_flight = True
        return True

    def end_attempt(self) -> bool:
        """The trial ended without a verdict (the client left); True if one was open."""
        was, self.trial_in_flight = self.trial_in_flight, False
        return was

    def record_success(self) -> None:
        self.trial_in_flight = False
        if self.state is CircuitState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self._config.half_open_successes:
                self.state = CircuitState.CLOSED
                self.failures = 0
        else:
            self.failures = 0

    def record_failure(self, now: float) -> None:
        self.trial_in_flight = False
        if self.state is CircuitState.HALF_OPEN:
            self._open(now)
            return
        self.failures += 1
        if self.state is CircuitState.CLOSED and self.failures >= self._config.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = CircuitState.OPEN
        self._opened_at = now
        self._successes = 0

    def reset(self) -> None:
        self.state = CircuitState.CLOSED
        self.failures = 0
        self._successes = 0
        self.trial_in_flight = False
