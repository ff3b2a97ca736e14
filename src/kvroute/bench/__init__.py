"""The benchmark harness: workloads, trace replay, load generator, metrics, reports.

Public API (imported lazily, so ``kvroute.bench.workloads`` stays free of aiohttp for
the discrete-event simulator):

- ``make_workload(name, seed=, overrides=, trace_path=)`` -> ``Workload``
- ``LoadConfig`` / ``default_load(workload, **overrides)``
- ``await run_benchmark(target_url, workload, load_config, backend_metrics_urls, ...)``
  -> ``BenchResult`` (``.result`` is result.json, ``.records`` the per-request records)
- ``format_summary(result)``, ``write_outputs(bench_result, out_dir)``,
  ``rich_progress(description, total, duration_s)``
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "make_workload": "kvroute.bench.workloads",
    "Workload": "kvroute.bench.workloads",
    "LoadConfig": "kvroute.bench.load",
    "default_load": "kvroute.bench.load",
    "run_benchmark": "kvroute.bench.runner",
    "BenchResult": "kvroute.bench.runner",
    "format_summary": "kvroute.bench.report",
    "write_outputs": "kvroute.bench.report",
    "rich_progress": "kvroute.bench.progress",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvroute.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
