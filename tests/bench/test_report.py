"""records.jsonl: what ``write_outputs`` writes, ``read_records`` reads back."""

from __future__ import annotations

import dataclasses
import json
import math

from kvroute.bench.compare_report import read_records
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.report import write_outputs
from kvroute.bench.runner import BenchResult

ANSWERED = RequestRecord(
    request_id="r0", prefix_group="g0", session_id="s0", turn=2, start_s=0.25, ok=True,
    ttft_s=0.1, itl_s=(0.01, 1e-7, 0.02), e2e_s=0.4, prompt_tokens=10, output_tokens=3,
    cached_tokens=4, backend="http://b0", decision="prefix", status=200,
)  # fmt: skip
CUT = RequestRecord(
    request_id="r1", prefix_group="g1", session_id=None, turn=0, start_s=-1.5, ok=False,
    ttft_s=None, itl_s=(), e2e_s=math.inf, prompt_tokens=7, output_tokens=0,
    cached_tokens=None, backend=None, error="cut", warmup=True,
)  # fmt: skip


def test_records_round_trip_with_non_finite_times_as_null(tmp_path):
    bench = BenchResult({"workload": {"name": "w"}}, [ANSWERED, CUT])
    path = write_outputs(bench, tmp_path, plots=False)["records"]
    lines = path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["r0", "r1"]
    assert json.loads(lines[1])["e2e_s"] is None  # strict JSON: inf is not a number
    assert read_records(path) == [ANSWERED, dataclasses.replace(CUT, e2e_s=None)]
