"""The Fleet's settings (``FleetConfig``): one frozen dataclass, checked when it is built.

A module of its own so that the Fleet (core/fleet.py) and the parts beside it read the
settings without importing one another, and so that the router, which builds them from
its configuration (router/app.py), needs nothing else from the core to do so. The cost
model's own settings are ``CostConfig`` (core/cost.py), nested here as ``cost``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.core.cost import CostConfig
from kvroute.core.kv_sync import MODES
from kvroute.core.sessions import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet-wide knobs."""

    default_block_size: int = 16  # tokens per block until a backend's block size is scraped
    default_capacity_blocks: int = 8192  # cache-model size until num_gpu_blocks is scraped
    max_index_entries: int = 2_000_000  # hard cap on (block, backend) entries (~150-300 B each)
    cost: CostConfig = field(default_factory=CostConfig)  # TTFT estimate and rate learning
    # "approximate": text keys, LRU models fed by dispatches; "exact": token keys, each
    # backend's view from its KV events while its stream is synced (LRU fallback
    # otherwise); "auto": token keys for a model only while one of its backends is synced
    mode: str = "approximate"
    speculative_ttl_s: float = 3.0  # exact mode: unconfirmed dispatch credit lives this long
    # session affinity (core/sessions.py): a session's last backend is forgotten this long
    # after its last request, and at most this many sessions are kept (least recent out)
    session_ttl_s: float = DEFAULT_TTL_S
    session_max_entries: int = DEFAULT_MAX_ENTRIES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fleet.mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.speculative_ttl_s >= 0:
            raise ValueError("fleet.speculative_ttl_s: must be >= 0")
        if self.default_block_size < 1:
            raise ValueError("fleet.default_block_size: must be >= 1")
        if self.default_capacity_blocks < 1:
            raise ValueError("fleet.default_capacity_blocks: must be >= 1")
        if self.max_index_entries < 1:
            raise ValueError("fleet.max_index_entries: must be >= 1")
        if not self.session_ttl_s > 0:
            raise ValueError("fleet.session_ttl_s: must be > 0")
        if self.session_max_entries < 1:
            raise ValueError("fleet.session_max_entries: must be >= 1")
