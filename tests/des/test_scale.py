"""The fleet-size sweep on a tiled trace: each size gets its share of copies."""

from __future__ import annotations

import json

from kvroute.des.scale import format_points, plot_points, run_scale, tiled_trace

from .helpers import small_profile

ROWS = [
    {
        "timestamp": t * 400,
        "input_length": 300 + 7 * t,
        "output_length": 8,
        "hash_ids": [0, t % 3 + 1],
    }
    for t in range(12)
]


def test_sizes_scale_the_traffic_with_the_fleet(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    make = tiled_trace(str(trace), {"spread_ms": "0"}, 0)
    points = run_scale(make, small_profile(), [2, 4], ["round_robin", "kvroute"], base_backends=2)
    assert [(p.num_backends, p.router) for p in points] == [
        (2, "round_robin"), (2, "kvroute"), (4, "round_robin"), (4, "kvroute"),
    ]  # fmt: skip
    assert [p.figures["completed"] for p in points] == [12, 12, 24, 24]
    for p in points:  # the copies are disjoint: the ceiling does not grow with them
        assert p.figures["cache_ceiling_hit_rate"] == points[0].figures["cache_ceiling_hit_rate"]
        assert p.figures["engine_prefix_hit_rate"] <= p.figures["belady_hit_rate"]
    assert "| 4 | kvroute |" in format_points(points)
    assert plot_points(points, tmp_path / "s.png", "t").stat().st_size > 0
