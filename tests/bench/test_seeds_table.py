"""scripts/seeds_table.py: means, ranges and the best of each column over seed folders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "seeds_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("seeds_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, rr_p99: float, kv_p99: float) -> Path:
    folder.mkdir()
    row = {"engine_prefix_hit_rate": 0.1, "mean_ttft_ms": 100.0, "p50_ttft_ms": 90.0}
    runs = {
        "round_robin": {**row, "p99_ttft_ms": rr_p99, "request_throughput": 2.0},
        "kvroute": {**row, "engine_prefix_hit_rate": 0.5, "p99_ttft_ms": kv_p99,
                    "request_throughput": None},
    }  # fmt: skip
    (folder / "compare.json").write_text(json.dumps(runs))
    return folder


def test_means_ranges_and_the_best_of_each_column(tmp_path) -> None:
    seeds = _script()
    folders = [_run(tmp_path / "s0", 300.0, 200.0), _run(tmp_path / "s1", 500.0, 400.0)]
    lines = seeds.format_table(seeds.read_runs(folders)).splitlines()
    assert lines[0].startswith("| router | runs | engine hit %")
    rr, kv = lines[2], lines[3]
    assert rr.startswith("| round_robin | 2 | 10.0 (10.0-10.0) |")
    assert "| 400 (300-500) |" in rr and "| **2.00** (2.00-2.00) |" in rr
    assert kv.startswith("| kvroute | 2 | **50.0** (50.0-50.0) |")
    assert "| **300** (200-400) |" in kv and kv.endswith("| - |")  # no throughput given
