"""Capacity planning: the smallest fleet per router that meets a P99 TTFT objective.

``kvroute simulate --plan`` asks, for each router, how many replicas the workload needs
so that its P99 time to first token stays within ``--slo-ttft-p99`` seconds, and what
that fleet costs a month at ``--gpu-cost-per-hour`` dollars a GPU (a tensor-parallel
profile counts its ``gpus`` per replica). The saving of a router is round-robin's
monthly cost minus its own: the GPUs a cache-aware router frees for the same traffic.

The search runs the simulator at doubling fleet sizes until one meets the objective,
then bisects between the last size that failed and the first that met it, so a router
needing N replicas costs about 2 log2(N) runs. It assumes that more replicas never hurt
the P99 for the same traffic, which holds for an open-loop rate (and for a closed loop's
users, whose load only falls as the fleet grows). A fleet meets the objective when its
P99 TTFT is within it and at most ``MAX_FAILED_SHARE`` of its requests failed (requests a
fleet cuts or times out never reach the TTFT figures, so they must not pass silently).
Requests the engines refuse as malformed for them (a 4xx: a prompt longer than the
model's context) fail at every fleet size; they are reported, not counted against it.

Pure of I/O: the probe (one simulator run) is a callable; the command line supplies it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvroute.bench.metrics import RequestRecord, measured
from kvroute.common.text_table import text_table

HOURS_PER_MONTH = 730.0  # 8,760 hours a year / 12, the cloud providers' month
MAX_FAILED_SHARE = 0.01  # a fleet failing more of its requests than this misses the SLO


@dataclass(frozen=True, slots=True)
class Probe:
    """One simulator run of a router on a fleet of ``replicas``."""

    replicas: int
    p99_ttft_s: float | None  # None: no request produced a first token
    hit_rate: float | None  # engine-measured prefix-cache hit rate
    throughput: float  # requests per second of engine time
    num_requests: int  # measured requests, refused ones included
    num_failed: int  # failed for the fleet's sake (refused ones excluded)
    num_refused: int = 0  # refused by the engines as invalid for the model (4xx)

    @property
    def num_served(self) -> int:
        return self.num_requests - self.num_failed - self.num_refused

    def meets(self, slo_ttft_p99_s: float) -> bool:
        if self.p99_ttft_s is None or self.num_served <= 0:
            return False  # nothing served has no P99 (the figures say 0 for an empty set)
        failed_share = self.num_failed / max(1, self.num_requests - self.num_refused)
        return self.p99_ttft_s <= slo_ttft_p99_s and failed_share <= MAX_FAILED_SHARE

    @classmethod
    def from_result(cls, replicas: int, result: dict[str, Any], num_refused: int = 0) -> Probe:
        """From a ``compare.json``-style result of ``simulate_router``; ``num_refused`` of
        its failures were 4xx refusals (``refused``)."""
        p99_ms = result.get("p99_ttft_ms")
        completed, failed = int(result.get("completed") or 0), int(result.get("failed") or 0)
        return cls(
            replicas=replicas,
            p99_ttft_s=None if p99_ms is None or not completed else p99_ms / 1000.0,
            hit_rate=result.get("engine_prefix_hit_rate"),
            throughput=float(result.get("request_throughput") or 0.0),
            num_requests=completed + failed,
            num_failed=failed - num_refused,
            num_refused=num_refused,
        )


def refused(records: Iterable[RequestRecord]) -> int:
    """Measured requests the engines refused as invalid for the model (HTTP 4xx)."""
    return sum(1 for r in measured(records) if r.status is not None and 400 <= r.status < 500)


@dataclass(slots=True)
class RouterPlan:
    """The search for one router: every probe, and the smallest fleet that met the SLO."""

    router: str
    probes: list[Probe] = field(default_factory=list)
    best: Probe | None = None  # None: not met up to the search's largest fleet


def smallest_fleet(
    router: str,
    probe: Callable[[int], Probe],
    slo_ttft_p99_s: float,
    *,
    min_replicas: int = 1,
    max_replicas: int = 1024,
) -> RouterPlan:
    """The smallest fleet in [min_replicas, max_replicas] whose probe meets the SLO
    (doubling, then bisection; each size runs at most once)."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min replicas ({min_replicas}) <= max ({max_replicas})")
    plan = RouterPlan(router)
    seen: dict[int, Probe] = {}

    def run(n: int) -> Probe:
        if n not in seen:
            seen[n] = probe(n)
            plan.probes.append(seen[n])
        return seen[n]

    failed, n = min_replicas - 1, min_replicas
    while not run(n).meets(slo_ttft_p99_s):
        if n == max_replicas:
            return plan
        failed, n = n, min(2 * n, max_replicas)
    met = n
    while met - failed > 1:
        mid = (failed + met) // 2
        if run(mid).meets(slo_ttft_p99_s):
            met = mid
        else:
            failed = mid
    plan.best = seen[met]
    plan.probes.sort(key=lambda p: p.replicas)
    return plan


@dataclass(frozen=True, slots=True)
class Pricing:
    gpu_cost_per_hour: float  # dollars per GPU-hour
    gpus_per_replica: int  # the profile's tensor-parallel degree

    def monthly(self, replicas: int) -> float:
        return replicas * self.gpus_per_replica * self.gpu_cost_per_hour * HOURS_PER_MONTH


def plan_rows(plans: Sequence[RouterPlan], pricing: Pricing, baseline: str) -> list[dict[str, Any]]:
    """One row per router: replicas, GPUs, monthly cost, saving against ``baseline``."""
    base = next((p.best for p in plans if p.router == baseline), None)
    base_cost = None if base is None else pricing.monthly(base.replicas)
    rows = []
    for plan in plans:
        best = plan.best
        row: dict[str, Any] = {"router": plan.router, "met": best is not None}
        if best is not None:
            cost = pricing.monthly(best.replicas)
            row.update(
                replicas=best.replicas,
                gpus=best.replicas * pricing.gpus_per_replica,
                p99_ttft_s=best.p99_ttft_s,
                hit_rate=best.hit_rate,
                monthly_cost=cost,
                saving_per_month=None if base_cost is None else base_cost - cost,
                saving_share=None if not base_cost else (base_cost - cost) / base_cost,
                refused=best.num_refused,
            )
        rows.append(row)
    return rows


def format_plan(rows: Sequence[dict[str, Any]], slo_s: float, pricing: Pricing, top: int) -> str:
    """The plan as a text table."""
    header = ["router", "replicas", "GPUs", "P99 TTFT s", "hit", "$ / month", "saving / month"]
    lines = [header]
    for r in rows:
        if not r["met"]:
            lines.append([r["router"], f"> {top}", "-", "not met", "-", "-", "-"])
            continue
        saving = r["saving_per_month"]
        lines.append(
            [
                r["router"],
                str(r["replicas"]),
                str(r["gpus"]),
                f"{r['p99_ttft_s']:.2f}",
                "n/a" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f} %",
                f"{r['monthly_cost']:,.0f}",
                "-" if saving is None else f"{saving:,.0f} ({100 * r['saving_share']:.0f} %)",
            ]
        )
    title = (
        f"Smallest fleet meeting P99 TTFT <= {slo_s:g} s (engine time), at "
        f"${pricing.gpu_cost_per_hour:g} per GPU-hour, {pricing.gpus_per_replica} GPU(s) a "
        f"replica, {HOURS_PER_MONTH:g} hours a month:"
    )
    refused = max((r.get("refused", 0) for r in rows), default=0)
    note = (
        f"\n({refused} requests refused by the engines as too long for the model, at every "
        "size: left out of the failure count)"
        if refused
        else ""
    )
    return f"{title}\n{text_table(lines)}{note}"


def plan_json(
    plans: Sequence[RouterPlan], rows: Sequence[dict[str, Any]], settings: dict[str, Any]
) -> dict[str, Any]:
    return {
        **settings,
        "routers": list(rows),
        "probes": {p.router: [asdict(x) for x in p.probes] for p in plans},
    }


def plot_plan(plans: Sequence[RouterPlan], slo_s: float, path: Path, title: str) -> Path:
    """P99 TTFT against replicas for every probe of every router, the SLO as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    for plan in plans:
        probes = [p for p in plan.probes if p.p99_ttft_s is not None]
        (line,) = ax.plot(
            [p.replicas for p in probes], [p.p99_ttft_s for p in probes], marker="o",
            label=plan.router,
        )  # fmt: skip
        if plan.best is not None and plan.best.p99_ttft_s is not None:
            ax.plot([plan.best.replicas], [plan.best.p99_ttft_s], marker="*", markersize=14,
                    color=line.get_color())  # fmt: skip
    ax.axhline(slo_s, ls="--", color="grey", label=f"SLO {slo_s:g} s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("P99 TTFT (s, engine time)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
