"""Client API keys, per-key limits, and the client address behind trusted proxies.

A key's limits are a concurrency cap and a token bucket (``rate_per_s``, ``burst``);
over either -> 429 with ``Retry-After``. With no keys configured the router is open and
only the client's own Authorization header travels upstream.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.router.config import ClientKey, IpNetwork
from kvroute.router.errors import RateLimited, Unauthorized


@dataclass(slots=True)
class KeyState:
    """Live counters of one client key."""

    key: ClientKey
    in_flight: int = 0  # admitted and not yet released
    tokens: float = 0.0  # token bucket level (requests)
    updated_s: float = 0.0  # clock time of the last refill

    @property
    def burst(self) -> float:
        if self.key.burst is not None:
            return float(self.key.burst)
        return max(1.0, self.key.rate_per_s or 1.0)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ClientGate:
    """Admits or refuses a request by key; ``release`` must follow every admit."""

    def __init__(self, keys: Sequence[ClientKey], clock: Callable[[], float]) -> None:
        self._clock = clock
        now = clock()
        self._by_key = {k.key: KeyState(k, updated_s=now) for k in keys}
        for st in self._by_key.values():
            st.tokens = st.burst
        self.require_key = bool(self._by_key)

    def states(self) -> list[KeyState]:
        return list(self._by_key.values())

    def admit(self, authorization: str | None) -> KeyState | None:
        """The caller's KeyState (None when keys are off); raises Unauthorized/RateLimited."""
        if not self.require_key:
            return None
        token = bearer_token(authorization)
        st = self._by_key.get(token) if token else None
        if st is None:
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer KEY')")
        key = st.key
        if key.max_concurrency is not None and st.in_flight >= key.max_concurrency:
            raise RateLimited(
                f"key '{key.name}' has {st.in_flight} requests in flight "
                f"(limit {key.max_concurrency})",
                headers={"Retry-After": "1"},
            )
        if key.rate_per_s is not None:
            now = self._clock()
            st.tokens = min(st.burst, st.tokens + (now - st.updated_s) * key.rate_per_s)
            st.updated_s = now
            if st.tokens < 1.0:
                wait_s = (1.0 - st.tokens) / key.rate_per_s
                raise RateLimited(
                    f"key '{key.name}' is over its rate limit ({key.rate_per_s:g} req/s)",
                    headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
                )
            st.tokens -= 1.0
        st.in_flight += 1
        return st

    @staticmethod
    def release(st: KeyState | None) -> None:
        if st is not None:
            st.in_flight -= 1


def client_address(
    peer: str | None, forwarded_for: str | None, trusted: Sequence[IpNetwork]
) -> str | None:
    """The client's address: X-Forwarded-For is believed only hop by hop from trusted proxies.

    Walks the header right to left while the current hop is a trusted proxy; the first
    untrusted address is the client.
    """
    if not trusted or not forwarded_for or peer is None or not is_trusted(peer, trusted):
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    current = peer
    while hops and is_trusted(current, trusted):
        current = hops.pop()
    return current


def is_trusted(addr: str, trusted: Sequence[IpNetwork]) -> bool:
    """Whether ``addr`` lies in one of the ``trusted`` proxy networks."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return any(ip in net for net in trusted)
