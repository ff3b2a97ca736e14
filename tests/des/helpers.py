"""Small simulations shared by the discrete-event simulator's tests."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvroute.bench.load import LoadConfig, default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.runner import BenchResult
from kvroute.bench.workloads import make_workload
from kvroute.des.simulation import Timing, simulate_router
from kvroute.engine import PROFILES, EngineProfile

SMALL = {
    "ranvier-stress": {"large_prefix_tokens": "120,160,300,400", "xlarge_min_tokens": "250"},
    "gsp": {
        "num_groups": "12",
        "system_prompt_tokens": "600",
        "question_tokens": "40",
        "output_tokens": "60",
    },
    "multiturn": {},
    "zipf-hot": {},
}


def small_profile(**changes: Any) -> EngineProfile:
    """codellama-13b's step costs on a cache small enough to evict within a short run."""
    base = PROFILES["codellama-13b-a100-40g"]
    fields = {"name": "small", "kv_capacity_tokens": 6_000, "max_model_len": 6_000}
    return dataclasses.replace(base, **{**fields, **changes})


def simulate(
    router: str,
    workload: str = "gsp",
    *,
    seed: int = 0,
    num_requests: int = 120,
    num_backends: int = 3,
    profile: EngineProfile | None = None,
    fast_forward: bool = True,
    timing: Timing | None = None,
    prepare_ahead: bool | None = None,
    **load: Any,
) -> BenchResult:
    w = make_workload(workload, seed=seed, overrides=SMALL.get(workload, {}))
    config: LoadConfig = default_load(w, num_requests=num_requests, seed=seed, **load)
    result, _ = simulate_router(
        parse_router(router),
        profile or small_profile(),
        num_backends,
        w,
        config,
        fast_forward=fast_forward,
        timing=timing,
        prepare_ahead=prepare_ahead,
    )
    return result


def canonical(result: BenchResult, *, ignore_fast_forward: bool = True) -> str:
    """The result and every record as one string (for byte-equality checks); by default
    without what says how the engines were stepped (fast-forward on or off)."""
    data = json.loads(json.dumps(result.result))
    if ignore_fast_forward:
        del data["config"]["fast_forward"]
        del data["simulation"]["events"], data["simulation"]["fast_forwards"]
    records = [dataclasses.asdict(r) for r in result.records]
    return json.dumps({"result": data, "records": records}, sort_keys=True)
