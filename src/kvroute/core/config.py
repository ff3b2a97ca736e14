"""The Fleet's settings (``FleetConfig``) and the fixed value sets the Fleet speaks.

A module of its own so that the Fleet (core/fleet.py) and the parts beside it read the
settings without importing one another, and so that the router, which builds them from
its configuration (the ``fleet:`` section, router/config.py), needs nothing else from
the core to do so. The cost model's own settings are ``CostConfig`` (core/cost.py),
nested here as ``cost``. Fields, types, defaults and ranges are declared once
(core/params.py); ``__post_init__`` checks them.

The value sets are ``StrEnum``s: each member is its string, so JSON, response headers,
metric labels and comparisons with plain strings see what they saw before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from kvroute.core.cost import CostConfig
from kvroute.core.params import check_ranges, param, parse_value
from kvroute.core.sessions import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S


class Mode(enum.StrEnum):
    """Which routing keys the Fleet uses and where its cache views come from."""

    APPROXIMATE = "approximate"  # text keys, LRU models fed by dispatches
    # token keys, each backend's view from its KV events while its stream is synced
    # (LRU fallback otherwise)
    EXACT = "exact"
    AUTO = "auto"  # token keys for a model only while one of its backends is synced


class KeyKind(enum.StrEnum):
    """Which block keys a request needs (``Fleet.key_kind_for``)."""

    TEXT = "text"  # prompt_block_hashes over the rendered prompt text
    TOKENS = "tokens"  # token_block_hashes over the engine's token ids


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet-wide knobs. The router sets ``mode`` from its own ``mode`` and the session
    sizes from its ``sessions`` section; the rest is its ``fleet`` section."""

    SECTION: ClassVar[str] = "fleet"

    # tokens per block until a backend's block size is scraped
    default_block_size: int = param(16, ge=1)
    # cache-model size, blocks, until num_gpu_blocks is scraped
    default_capacity_blocks: int = param(8192, ge=1)
    # cap on (block, backend) entries of the index (~150-300 B each); 0: as many as the
    # backends' caches hold together (their cache models' capacities), growing with the
    # fleet: 1,024 engines of 27,500 blocks need 28M entries, which a fixed cap would cut
    max_index_entries: int = param(0, ge=0)
    cost: CostConfig = field(default_factory=CostConfig)  # TTFT estimate and rate learning
    mode: Mode = Mode.APPROXIMATE
    # exact mode: credit for a dispatch until the backend's KV events confirm it, seconds
    speculative_ttl_s: float = param(3.0, ge=0, le=600)
    # session affinity (core/sessions.py): a session's last backend is forgotten this long
    # after its last request, and at most this many sessions are kept (least recent out)
    session_ttl_s: float = param(DEFAULT_TTL_S, gt=0, le=604_800)
    session_max_entries: int = param(DEFAULT_MAX_ENTRIES, ge=1, le=10_000_000)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_value(Mode, self.mode, "fleet.mode"))
        check_ranges(self, self.SECTION)
