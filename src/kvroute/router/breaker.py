"""Per-backend circuit breaker: closed -> open -> half-open -> closed.

Passive failures (connect error, 5xx, timeout before the first byte) count; a success
resets the count. After ``failure_threshold`` consecutive failures the circuit opens and
the backend takes no traffic for ``open_s``; then it is half-open: requests flow again,
one failure re-opens it, ``half_open_successes`` successes close it. Time is an argument.
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

    __slots__ = ("_config", "_opened_at", "_successes", "failures", "state")

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self.state = CircuitState.CLOSED
        self.failures = 0  # consecutive failures while closed
        self._successes = 0  # trial successes while half-open
        self._opened_at = 0.0

    def allows(self, now: float) -> bool:
        """Whether the backend may take requests; moves open -> half-open when due."""
        if self.state is CircuitState.OPEN and now - self._opened_at >= self._config.open_s:
            self.state = CircuitState.HALF_OPEN
            self._successes = 0
        return self.state is not CircuitState.OPEN

    def record_success(self) -> None:
        if self.state is CircuitState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self._config.half_open_successes:
                self.state = CircuitState.CLOSED
                self.failures = 0
        else:
            self.failures = 0

    def record_failure(self, now: float) -> None:
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
