"""One table over several runs of the same comparison (one folder per seed).

    python scripts/seeds_table.py runs/azure/conv-s0 runs/azure/conv-s1 runs/azure/conv-s2

Each folder is a ``kvroute compare`` or ``kvroute simulate`` output (its compare.json);
the table gives, per router, the mean over the folders and the range in brackets of the
engine hit rate, the mean, P50 and P99 TTFT and the request throughput, and marks the
best mean of each column with ``**``. Markdown, ready for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# column -> (compare.json key, scale, lower is better, format)
COLUMNS = {
    "engine hit %": ("engine_prefix_hit_rate", 100.0, False, "{:.1f}"),
    "mean TTFT ms": ("mean_ttft_ms", 1.0, True, "{:,.0f}"),
    "P50 TTFT ms": ("p50_ttft_ms", 1.0, True, "{:,.0f}"),
    "P99 TTFT ms": ("p99_ttft_ms", 1.0, True, "{:,.0f}"),
    "req/s": ("request_throughput", 1.0, False, "{:.2f}"),
}


def read_runs(folders: list[Path]) -> dict[str, dict[str, list[float]]]:
    """router -> column -> the value of each run, in the routers' order of the first run."""
    table: dict[str, dict[str, list[float]]] = {}
    for folder in folders:
        runs = json.loads((folder / "compare.json").read_text())
        for router, result in runs.items():
            row = table.setdefault(router, {c: [] for c in COLUMNS})
            for column, (key, scale, _, _) in COLUMNS.items():
                value = result.get(key)
                if value is not None:
                    row[column].append(value * scale)
    return table


def format_table(table: dict[str, dict[str, list[float]]]) -> str:
    means = {r: {c: statistics.fmean(v) for c, v in row.items() if v} for r, row in table.items()}
    best = {}
    for column, (_, _, lower, _) in COLUMNS.items():
        values = [m[column] for m in means.values() if column in m]
        if values:
            best[column] = min(values) if lower else max(values)
    lines = [
        "| router | runs | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for router, row in table.items():
        cells = []
        for column, (_, _, _, fmt) in COLUMNS.items():
            values = row[column]
            if not values:
                cells.append("-")
                continue
            mean = means[router][column]
            text = fmt.format(mean)
            if fmt.format(mean) == fmt.format(best[column]):
                text = f"**{text}**"
            if len(values) > 1:
                text += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
            cells.append(text)
        runs = max(len(v) for v in row.values())
        lines.append(f"| {router} | {runs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="compare output folders")
    args = parser.parse_args()
    print(format_table(read_runs(args.folders)))


if __name__ == "__main__":
    main()
