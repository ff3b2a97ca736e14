#!/usr/bin/env python3
"""Fidelity of ``kvroute simulate`` against ``kvroute compare`` (issue 13): one table.

For each workload, runs the HTTP rig (``kvroute compare``: real processes, real sockets,
engines at ``--speedup``) and the simulator (``kvroute simulate``: the same workload,
load, fleet and routers in virtual time, for speedup x the duration), then prints both
side by side in engine time (the rig's wall times x speedup, its req/s / speedup) with
the differences and whether each is inside the bar: engine hit rate within 2 points,
P50 and P99 TTFT within 15 %, throughput within 5 %.

    python scripts/des_fidelity.py --out runs/fidelity            # the four workloads
    python scripts/des_fidelity.py --workloads gsp --routers kvroute --duration 30
    python scripts/des_fidelity.py --workloads ranvier-stress,gsp,zipf-hot \
        --routers sglang=sglang-cache-aware,vllm-router=sglang-cache-aware   # peer models

A router given as RIG=SIM runs as RIG on the rig and as SIM in the simulator: a real peer
against its model.

``--sim-band K`` also simulates each router K more times with the proxy's latency per
request moved by 0.1 ms steps (0.5, 0.6, ... ms instead of 0.4), and shows the range of
the K + 1 runs beside the rig's figure: a router whose figures hang on sub-millisecond
timing (consistent hashing's bounded load on gsp moves its hit rate by 2-3 points so)
is then judged against its own spread, "in" when the rig falls inside the band widened
by the bar.

Writes fidelity.json and fidelity.md in --out, and each run's own folder beside them.
The rig runs one router at a time; keep the machine otherwise idle while it runs. The
simulator runs each router on the backend URLs that router's rig run had (consistent
hashing's ring and rendezvous tie-breaks are built on them); ``--skip-rig`` reruns only
the simulator against rig runs already in --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvroute.des.simulation import DEFAULT_REQUEST_OVERHEAD_S

TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)
WORKLOADS: dict[str, list[str]] = {
    "ranvier-stress": ["--workload", "ranvier-stress", "--concurrency", "30", "--num-warmup", "60"],
    "gsp": ["--workload", "gsp"],
    "zipf-hot": ["--workload", "zipf-hot"],
    "mooncake-slice": [
        "--workload", "mooncake", "--trace", str(TRACE),
        "--workload-arg", "max_requests=1500", "--workload-arg", "input_scale=0.1",
        "--workload-arg", "output_cap=64",
    ],
}  # fmt: skip
BARS = {"hit_pp": 2.0, "ttft_pct": 15.0, "throughput_pct": 5.0}
DEFAULT_OVERHEAD_MS = 1000 * DEFAULT_REQUEST_OVERHEAD_S  # kvroute simulate's default


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def figures(result: dict, speedup: float) -> dict[str, float | None]:
    """Engine-time figures of one router's result (``speedup``: the rig's)."""
    return {
        "hit": result.get("engine_prefix_hit_rate"),
        "p50": result["median_ttft_ms"] * speedup,
        "p99": result["p99_ttft_ms"] * speedup,
        "rps": result["request_throughput"] / speedup,
        "completed": result["completed"],
    }


def pct(sim: float, rig: float) -> float | None:
    return None if not rig else 100.0 * (sim - rig) / rig


def spread(rig: dict, sims: list[dict]) -> dict[str, dict]:
    """The simulations' range of each figure, and whether the rig's value lies inside it
    widened by the figure's bar (hit: points; TTFTs and req/s: per cent)."""
    out = {}
    for key, bar in (("hit", BARS["hit_pp"] / 100), ("p50", BARS["ttft_pct"]),
                     ("p99", BARS["ttft_pct"]), ("rps", BARS["throughput_pct"])):  # fmt: skip
        values = [s[key] for s in sims if s[key] is not None]
        if not values or rig[key] is None:
            continue
        lo, hi = min(values), max(values)
        if key == "hit":
            inside = lo - bar <= rig[key] <= hi + bar
        else:
            inside = lo * (1 - bar / 100) <= rig[key] <= hi * (1 + bar / 100)
        out[key] = {"min": lo, "max": hi, "rig_inside": inside}
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--routers", default="round_robin,consistent_hash,kvroute,kvroute-exact")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--profile", default="codellama-13b-a100-40g")
    p.add_argument("--speedup", type=float, default=4.0)
    p.add_argument("--duration", type=float, default=60.0, help="rig wall seconds per router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument("--skip-rig", action="store_true", help="reuse the rig's runs in --out")
    p.add_argument("--sim-band", type=int, default=0, metavar="K",
                   help="K more simulations per router, proxy latency in 0.1-ms steps")  # fmt: skip
    args = p.parse_args()
    out = Path(args.out)
    kv = [sys.executable, "-m", "kvroute.cli"]
    common = ["--backends", str(args.backends), "--profile", args.profile,
              "--seed", str(args.seed), "--no-plots", "--quiet"]  # fmt: skip
    pairs = dict(
        (r.split("=", 1) if "=" in r else (r, r)) for r in args.routers.split(",")
    )  # rig name -> simulator name
    rows = []
    for name in args.workloads.split(","):
        wl = WORKLOADS[name]
        rig_dir, sim_dir = out / f"{name}-rig", out / f"{name}-sim"
        if not args.skip_rig:
            run([*kv, "compare", *wl, *common, "--routers", ",".join(pairs),
                 "--speedup", str(args.speedup), "--duration", str(args.duration),
                 "--out", str(rig_dir)])  # fmt: skip
        rig = json.loads((rig_dir / "compare.json").read_text())
        sim = {}
        band: dict[str, list[dict]] = {router: [] for router in pairs}
        for router, model in pairs.items():  # on the rig's backend URLs: the same rings
            urls = rig.get(router, {}).get("config", {}).get("backend_metrics")
            names = ["--backend-urls", ",".join(urls)] if urls else []
            sim_cmd = [*kv, "simulate", *wl, *common, "--routers", model, *names,
                       "--duration", str(args.duration * args.speedup)]  # fmt: skip
            run([*sim_cmd, "--out", str(sim_dir / router)])
            sim[router] = json.loads((sim_dir / router / "compare.json").read_text())[model]
            for i in range(1, args.sim_band + 1):
                overhead_ms = DEFAULT_OVERHEAD_MS + 0.1 * i
                folder = sim_dir / f"{router}-band{i}"
                run([*sim_cmd, "--request-overhead-ms", f"{overhead_ms:.1f}", "--out", str(folder)])
                band[router].append(json.loads((folder / "compare.json").read_text())[model])
        for router in pairs:
            if "error" in rig.get(router, {"error": 1}) or "error" in sim.get(router, {"error": 1}):
                continue
            a, b = figures(rig[router], args.speedup), figures(sim[router], 1.0)
            label = router if pairs[router] == router else f"{router} / {pairs[router]}"
            row = {"workload": name, "router": label, "rig": a, "sim": b}
            row["hit_pp"] = (
                None if a["hit"] is None or b["hit"] is None else 100.0 * (b["hit"] - a["hit"])
            )
            row["p50_pct"], row["p99_pct"] = pct(b["p50"], a["p50"]), pct(b["p99"], a["p99"])
            row["rps_pct"] = pct(b["rps"], a["rps"])
            if band[router]:
                row["band"] = spread(a, [b, *(figures(r, 1.0) for r in band[router])])
            rows.append(row)
    table = format_table(rows)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(
        json.dumps({"args": vars(args), "bars": BARS, "rows": rows}, indent=2) + "\n"
    )
    (out / "fidelity.md").write_text(table + "\n")
    return 0


def _mark(value: float | None, bar: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.1f}" + ("" if abs(value) <= bar else " !")


def format_table(rows: list[dict]) -> str:
    head = ("| workload | router | hit rig / sim (pp) | P50 ms rig / sim (%) | "
            "P99 ms rig / sim (%) | req/s rig / sim (%) |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["rig"], r["sim"]
        hit = (
            "n/a"
            if a["hit"] is None or b["hit"] is None
            else f"{100 * a['hit']:.1f} / {100 * b['hit']:.1f} "
            f"({_mark(r['hit_pp'], BARS['hit_pp'])})"
        )
        lines.append(
            f"| {r['workload']} | {r['router']} | {hit} | "
            f"{a['p50']:.0f} / {b['p50']:.0f} ({_mark(r['p50_pct'], BARS['ttft_pct'])}) | "
            f"{a['p99']:.0f} / {b['p99']:.0f} ({_mark(r['p99_pct'], BARS['ttft_pct'])}) | "
            f"{a['rps']:.2f} / {b['rps']:.2f} ({_mark(r['rps_pct'], BARS['throughput_pct'])}) |"
        )
    lines.append(
        "(engine time; `!` marks a figure outside its bar: hit 2 pp, TTFT 15 %, req/s 5 %)"
    )
    banded = [r for r in rows if r.get("band")]
    if banded:
        lines += ["", "| workload | router | hit % sim band (rig) | P50 ms | P99 ms | req/s |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in banded:
            cells = [_band(r["band"].get(k), r["rig"][k], k == "hit") for k in
                     ("hit", "p50", "p99", "rps")]  # fmt: skip
            lines.append(f"| {r['workload']} | {r['router']} | " + " | ".join(cells) + " |")
        lines.append("(the simulator's range over its runs; `!` marks a rig figure outside "
                     "the range widened by the bar)")  # fmt: skip
    return "\n".join(lines)


def _band(band: dict | None, rig: float | None, is_hit: bool) -> str:
    if band is None or rig is None:
        return "n/a"
    scale, digits = (100.0, 1) if is_hit else (1.0, 0 if rig >= 10 else 2)
    lo, hi, at = band["min"] * scale, band["max"] * scale, rig * scale
    text = f"{lo:.{digits}f}-{hi:.{digits}f} ({at:.{digits}f})"
    return text + ("" if band["rig_inside"] else " !")


if __name__ == "__main__":
    sys.exit(main())
