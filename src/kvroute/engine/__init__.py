"""Pure vLLM-V1-like engine model: prefix-cached KV blocks, continuous batching with
chunked prefill, a step-time model and hardware/model profiles. No I/O and no clock:
a step returns its modelled duration.
Its KV events are the types of ``kvroute.common.kv_events``; a profile from a YAML
file is read by ``kvroute.sim.profiles``."""

from kvroute.engine.engine import Engine, EngineStats, StepResult, TokenOutput
from kvroute.engine.profiles import PROFILES, EngineProfile

__all__ = [
    "PROFILES",
    "Engine",
    "EngineProfile",
    "EngineStats",
    "StepResult",
    "TokenOutput",
]
