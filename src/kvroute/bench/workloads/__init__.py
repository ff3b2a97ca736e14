"""Named, seeded, deterministic workloads (docs/workloads.md).

``make_workload("gsp", seed=1, overrides={"num_groups": "8"})`` builds one;
``mooncake:PATH`` (or ``mooncake`` with ``trace_path``) replays a Mooncake trace;
``azure:PATH`` (or ``azure``) an Azure LLM inference trace, arrivals and lengths only,
every prompt new, through the same replay.
Everything here except the trace-file read in ``make_workload`` is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvroute.bench.workloads.agentic import Agentic, AgenticParams
from kvroute.bench.workloads.base import Workload, WorkloadDefaults, apply_overrides
from kvroute.bench.workloads.mooncake import MooncakeParams, MooncakeReplay, TraceRow
from kvroute.bench.workloads.multiturn import Multiturn, MultiturnParams, ZipfHot, ZipfHotParams
from kvroute.bench.workloads.ranvier import RanvierStress, RanvierStressParams
from kvroute.bench.workloads.shared_prefix import (
    B2b,
    B2bParams,
    Gsp,
    GspParams,
    PrefixRepetition,
    PrefixRepetitionParams,
)
from kvroute.bench.workloads.tiled import Tiled, copy_seed

# name -> (workload class, its parameter dataclass)
SYNTHETIC: dict[str, tuple[type[Workload], type]] = {
    "ranvier-stress": (RanvierStress, RanvierStressParams),
    "gsp": (Gsp, GspParams),
    "prefix-repetition": (PrefixRepetition, PrefixRepetitionParams),
    "b2b": (B2b, B2bParams),
    "multiturn": (Multiturn, MultiturnParams),
    "zipf-hot": (ZipfHot, ZipfHotParams),
    "agentic": (Agentic, AgenticParams),
}
TRACE_FORMATS = ("mooncake", "azure")  # ``NAME:PATH`` replays a trace in that format
WORKLOAD_NAMES: tuple[str, ...] = (*SYNTHETIC, *(f"{t}:PATH" for t in TRACE_FORMATS))


def make_workload(
    name: str,
    *,
    seed: int = 0,
    overrides: Mapping[str, str] | None = None,
    trace_path: str | Path | None = None,
) -> Workload:
    """The workload called ``name``; ValueError lists the known names or the bad parameter."""
    overrides = overrides or {}
    if name in SYNTHETIC:
        cls, params_cls = SYNTHETIC[name]
        own = {k: v for k, v in overrides.items() if k != "tile"}
        params = apply_overrides(params_cls(), own)
        copies = tile_count(overrides.get("tile", "1"))
        if copies == 1:
            return cls(params, seed)
        return Tiled([cls(params, copy_seed(seed, k)) for k in range(copies)])
    if name == "mooncake" or name.startswith("mooncake:"):
        from kvroute.bench.tracefile import DEFAULT_TRACE, read_mooncake_trace

        path = Path(name.partition(":")[2] or trace_path or DEFAULT_TRACE)
        params = apply_overrides(MooncakeParams(), overrides)
        rows = read_mooncake_trace(path, params.max_requests)
        return MooncakeReplay(rows, params, seed, source=str(path))
    if name == "azure" or name.startswith("azure:"):
        from kvroute.bench.tracefile import DEFAULT_AZURE_TRACE, read_azure_trace

        path = Path(name.partition(":")[2] or trace_path or DEFAULT_AZURE_TRACE)
        params = apply_overrides(MooncakeParams(), overrides)
        rows = read_azure_trace(path, params.max_requests)
        return MooncakeReplay(rows, params, seed, source=str(path), name="azure")
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")


def is_trace_replay(name: str) -> bool:
    """True for the workloads that replay a trace file (their rows set the arrivals)."""
    return name.partition(":")[0] in TRACE_FORMATS


def tile_count(text: str) -> int:
    """The ``tile`` override of a synthetic workload: copies, >= 1."""
    try:
        copies = int(text)
    except ValueError:
        copies = 0
    if copies < 1:
        raise ValueError(f"bad value {text!r} for workload parameter 'tile' (copies, >= 1)")
    return copies


__all__ = [
    "SYNTHETIC",
    "TRACE_FORMATS",
    "WORKLOAD_NAMES",
    "MooncakeReplay",
    "TraceRow",
    "Workload",
    "WorkloadDefaults",
    "is_trace_replay",
    "make_workload",
]
