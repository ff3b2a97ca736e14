"""A model of KubeAI's ``PrefixHash`` load balancing (CHWBL), for the simulator.

Follows kubeai-project/kubeai at f442a2c (Oct 2025): ``internal/loadbalancer/
balance_chwbl.go`` and ``group.go``, the defaults of ``api/k8s/v1/model_types.go``
(``PrefixHash``), the prefix of ``api/openai/v1/{completions,chat_completions}.go``;
described in ``../shared/docs/anchors/refresh-2026-11.md`` (consistent hashing with
bounded loads, one owner per prefix):

- the key is the request's first ``prefix_chars`` characters (``prefixCharLength``, 100);
- a ring with ``replication`` points per endpoint (256);
- walk the ring clockwise from the key's hash and take the first endpoint whose in-flight
  requests are at most ``mean_load_factor`` (``meanLoadFactor``, 125 %) x the mean with
  this request counted, (total in flight + 1) / endpoints; every endpoint is under it
  while nothing is in flight; if none is (it cannot happen with a factor >= 1), the key's
  owner. Load is the router's count of requests, not tokens, and no prefix cache is
  modelled: the predicted hit is 0.

Simplifications: the key is the prompt's first blocks of the router's keys, as many as
cover ``prefix_chars`` at 4 characters per token (2 blocks of 64 characters, i.e. 128),
where KubeAI takes exactly 100 characters of a completion's prompt and of a chat's
*first user message* (system messages are skipped: on a chat workload whose shared part
is the system prompt, KubeAI spreads what this model keeps together); a prompt under one
block hashes its request id; the ring is kvroute's (``consistent_hash.HashRing``: xxh3 of
``url#i``, KubeAI: xxhash64 of ``name`` + ``i``); endpoints are unweighted in the bound.
The in-flight count is the router's own (``LoadView.own_in_flight_requests``), as KubeAI's
proxy counts it: no engine gauge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvroute.core.keys import CHARS_PER_TOKEN  # text keys cut block_size x 4 characters
from kvroute.core.params import check_ranges, param
from kvroute.core.policy.base import (
    Decision,
    FleetView,
    Policy,
    Reason,
    RouteRequest,
    request_key,
    rest_by_load,
)
from kvroute.core.policy.consistent_hash import HashRing


@dataclass(frozen=True, slots=True)
class ChwblParams:
    """The model's knobs (YAML ``policies.chwbl``), KubeAI's ``PrefixHash`` defaults."""

    SECTION: ClassVar[str] = "chwbl"

    mean_load_factor: float = param(1.25, ge=1)  # meanLoadFactor 125 (%)
    replication: int = param(256, ge=1)  # ring points per endpoint
    prefix_chars: int = param(100, ge=1)  # prefixCharLength

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


class ChwblPolicy(Policy):
    """KubeAI's consistent hashing with bounded loads as the module docstring describes it."""

    name = "chwbl"
    Params = ChwblParams

    def __init__(self, params: ChwblParams | None = None) -> None:
        self.p = params or ChwblParams()
        self._ring = HashRing(self.p.replication)

    def choose(self, request: RouteRequest, view: FleetView, now: float) -> Decision | None:
        urls = view.candidates()
        if not urls:
            return None
        self._ring.refresh(view, urls)
        loads = {u: view.load(u).own_in_flight_requests for u in urls}
        total = sum(loads.values())
        bound = self.p.mean_load_factor * (total + 1) / len(loads)
        owner: str | None = None
        for url in self._ring.walk(self._key(request, view.block_size)):
            if url not in loads:  # excluded by a retry: the ring keeps it
                continue
            if owner is None:
                owner = url
            if total == 0 or loads[url] <= bound:
                reason = Reason.HASH if url == owner else Reason.LOAD
                return Decision(url, reason, 0, rest_by_load(view, [url]))
        url = owner or urls[0]
        return Decision(url, Reason.HASH, 0, rest_by_load(view, [url]))

    def _key(self, request: RouteRequest, block_tokens: int) -> int:
        """The chained key of the blocks that cover ``prefix_chars`` (module doc)."""
        hashes = request.block_hashes
        if not hashes:
            return request_key(request)
        num_blocks = -(-self.p.prefix_chars // max(1, block_tokens * CHARS_PER_TOKEN))
        return int(hashes[min(num_blocks, len(hashes)) - 1])
