"""The model-size x prefix-length sweep (des/sweep.py): cells, gains, the heat maps."""

from __future__ import annotations

import pytest

from kvroute.des.sweep import fits, format_cells, gains, plot_gains, run_sweep
from kvroute.engine import PROFILES


def test_a_small_sweep_measures_every_fitting_cell_and_its_gains(tmp_path) -> None:
    tiny = PROFILES["tiny"]
    assert fits(tiny, 256) and not fits(tiny, 8000)  # 8,000 + question + output > 8,192
    seen = []
    cells = run_sweep(
        [tiny], [64, 256, 8000], ["round_robin", "kvroute"],
        num_backends=2, users_per_backend=2, duration_s=5.0, on_cell=seen.append,
    )  # fmt: skip
    assert seen == cells
    assert [(c.prefix_tokens, c.router) for c in cells] == [
        (64, "round_robin"), (64, "kvroute"), (256, "round_robin"), (256, "kvroute"),
    ]  # fmt: skip
    for c in cells:
        assert c.figures["request_throughput"] > 0 and c.figures["p99_ttft_ms"] > 0
    ratios = gains(cells, "kvroute", "round_robin")
    assert set(ratios) == {("tiny", 64), ("tiny", 256)}
    rr, kv = cells[2].figures, cells[3].figures
    p99, tput = ratios[("tiny", 256)]
    assert p99 == pytest.approx(rr["p99_ttft_ms"] / kv["p99_ttft_ms"])
    assert tput == pytest.approx(kv["request_throughput"] / rr["request_throughput"])
    table = format_cells(cells, "kvroute", "round_robin")
    assert table.count("\n") == 1 + len(cells) and f"{tput:.2f}x" in table
    assert plot_gains(cells, "kvroute", "round_robin", tmp_path / "s.png", "t").stat().st_size
