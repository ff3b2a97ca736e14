"""The contract of whoever else must hear of the Fleet's request path: ``FleetListener``.

Kept apart from the Fleet (core/fleet.py) as the policy contract is (core/policy/base.py):
an implementation (router/worker_sync.py mirrors each worker's Fleet onto its peers)
needs these four calls, not the Fleet. The Fleet calls every listener in
``Fleet.listeners`` after each change, once per ticket and kind.
"""

from __future__ import annotations

from typing import Protocol

from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision, RouteRequest


class FleetListener(Protocol):
    """Told of each request-path call that changed the Fleet, once per ticket and kind.

    Lets another process mirror this Fleet (router/worker_sync.py) without the Fleet
    knowing how. Called synchronously, after the change; must not raise.
    """

    def on_dispatch(
        self, ticket: Ticket, decision: Decision, req: RouteRequest, now: float
    ) -> None:
        """``dispatch`` created ``ticket``."""

    def on_first_token(self, ticket: Ticket, now: float, cached_tokens: int | None) -> None:
        """``ticket``'s first token (with the engine-reported cached tokens, when known)."""

    def on_cached_tokens(self, ticket: Ticket, cached_tokens: int) -> None:
        """The engine reported ``ticket``'s cached tokens after its first token."""

    def on_finish(self, ticket: Ticket, now: float, ok: bool) -> None:
        """``ticket`` ended."""
