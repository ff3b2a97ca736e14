"""Fidelity smoke test: the simulator against the HTTP rig on one small run (seconds).

One client sends its requests one after another, so placement and the engines' caches
do not depend on timing: the real processes (``kvroute compare``: simulated engines and
the router on loopback sockets) and the simulator (``kvroute simulate``'s engine model,
Fleet and policies in virtual time, on the rig's backend URLs) see the same requests in
the same order and must report the same engine counters. kvroute's prefill rate, which
it learns from first tokens, is pinned by a router config both sides run with: on a
loaded machine the rig's wall-clock first tokens move each backend's learned rate by a
few percent, which reorders two idle backends' estimates. ``scripts/des_fidelity.py``
is the full check (latencies and throughput under load, minutes per router).
"""

from __future__ import annotations

import pytest

from kvroute.bench.compare import CompareConfig, run_compare_async
from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.workloads import make_workload
from kvroute.des.simulation import simulate_router
from kvroute.engine import PROFILES

from .helpers import SMALL

ROUTERS = ("round_robin", "consistent_hash", "kvroute", "kvroute-exact")
BACKENDS = 2
# 20 groups of 600-token system prompts against 2 x 8,192 tokens of KV: copies evict
WORKLOAD = {**SMALL["gsp"], "num_groups": "20"}
LOAD = {"mode": "closed", "num_users": 1, "think_time_s": (0.0, 0.0), "num_requests": 60}
FIXED_RATE = "fleet:\n  cost: {min_prefill_tokens_per_s: 10000, max_prefill_tokens_per_s: 10000}\n"


@pytest.mark.slow
async def test_one_sequential_client_gets_the_rigs_engine_counters_in_the_simulator(tmp_path):
    router_config = tmp_path / "router.yaml"
    router_config.write_text(FIXED_RATE)
    config = CompareConfig("gsp", ROUTERS, num_backends=BACKENDS, profile="tiny",
                           workload_overrides=WORKLOAD, load_overrides=LOAD,
                           progress=False, router_config=str(router_config))  # fmt: skip
    outcomes = await run_compare_async(config)
    workload = make_workload("gsp", seed=0, overrides=WORKLOAD)
    load = default_load(workload, seed=0, **LOAD)
    for name in ROUTERS:
        rig = outcomes[name].bench
        assert rig is not None, outcomes[name].error
        urls = rig.result["config"]["backend_metrics"]
        sim, _ = simulate_router(parse_router(name), PROFILES["tiny"], BACKENDS, workload,
                                 load, urls=urls, router_config=str(router_config))  # fmt: skip
        for result in (rig.result, sim.result):
            assert result["completed"] == LOAD["num_requests"] and result["failed"] == 0
        rig_rows = {row["backend"]: row for row in rig.result["per_backend"]}
        sim_rows = {row["backend"]: row for row in sim.result["per_backend"]}
        assert rig_rows.keys() == sim_rows.keys(), name
        for url, row in rig_rows.items():  # what each engine counted, request by request
            for key in ("num_requests", "prefix_cache_queries", "prefix_cache_hits"):
                assert sim_rows[url][key] == row[key], (name, url, key)
