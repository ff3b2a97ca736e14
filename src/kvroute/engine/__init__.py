"""Pure vLLM-V1-like engine model: prefix-cached KV blocks, continuous batching with
chunked prefill, a step-time model and hardware/model profiles. No I/O; time is passed in."""

from kvroute.engine.engine import Engine, EngineStats, StepResult, TokenOutput
from kvroute.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_batch,
    encode_batch,
)
from kvroute.engine.profiles import PROFILES, EngineProfile, get_profile, load_profile

__all__ = [
    "PROFILES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Engine",
    "EngineProfile",
    "EngineStats",
    "KvEvent",
    "StepResult",
    "TokenOutput",
    "decode_batch",
    "encode_batch",
    "get_profile",
    "load_profile",
]
