"""One row of facts per backend, shared by the status page, /admin/backends and /metrics."""

from __future__ import annotations

import html
from typing import Any

from aiohttp import web

from kvroute.common.vllm_metrics import EngineMetrics
from kvroute.core.backend import BackendState
from kvroute.router.backends import BackendRuntime
from kvroute.router.state import STATE, RouterState


def backend_rows(state: RouterState) -> list[dict[str, Any]]:
    """Facts per backend; keys match the BackendCollector gauge names plus a few texts."""
    # due speculations gone first, also with no traffic
    fleet_states = {s.url: s for s in state.fleet.backend_states(state.clock())}
    rows = []
    for rt in state.backends:
        fs = fleet_states.get(rt.url)
        eng = rt.engine
        row = _engine_row(rt, fs, eng)
        row.update(_kv_row(state, rt.url, fs))
        rows.append(row)
    return rows


def _kv_row(state: RouterState, url: str, fs: BackendState | None) -> dict[str, Any]:
    """Exact-mode facts: the view's mode, its event feed, predicted vs reported hits."""
    sub = state.kv.status(url) if state.kv is not None else None
    row: dict[str, Any] = {"mode": fs.mode if fs else None}
    row["kv_endpoint"] = sub.endpoint if sub else None
    row["kvroute_backend_kv_feed_up"] = int(sub.running) if sub else None
    row["kvroute_backend_kv_replays"] = sub.num_replays if sub else None
    row["kvroute_backend_kv_malformed_batches"] = sub.num_malformed_batches if sub else None
    row["kvroute_backend_kv_bad_messages"] = sub.num_bad_messages if sub else None
    row["kvroute_backend_kv_disconnects"] = sub.num_disconnects if sub else None
    row["kvroute_backend_kv_feed_restarts"] = sub.num_feed_restarts if sub else None
    row["kvroute_backend_kv_overflows"] = sub.num_overflows if sub else None
    row["kvroute_backend_kv_skipped_stores"] = sub.num_skipped if sub else None
    if fs is None:
        return row
    if sub is not None:  # stream counters only where events are followed
        row["kvroute_backend_kv_lag_seconds"] = fs.kv_lag_s
        row["kvroute_backend_kv_events"] = fs.kv_num_events
        row["kvroute_backend_kv_gaps"] = fs.kv_num_gaps
        row["kvroute_backend_kv_restarts"] = fs.kv_num_restarts
    row["kvroute_backend_kv_exact"] = int(fs.mode == "exact")
    row["kvroute_backend_speculative_blocks"] = fs.speculative_blocks
    row["kvroute_backend_router_in_flight_requests"] = fs.own_in_flight_requests
    row["kvroute_backend_reported_hit_rate"] = _ratio(
        fs.reported_hit_tokens, fs.reported_query_tokens
    )
    row["kvroute_backend_reported_predicted_hit_rate"] = _ratio(
        fs.reported_predicted_tokens, fs.reported_query_tokens
    )
    row["kvroute_backend_prediction_exact_ratio"] = _ratio(fs.num_reported_exact, fs.num_reported)
    return row


def _engine_row(
    rt: BackendRuntime, fs: BackendState | None, eng: EngineMetrics | None
) -> dict[str, Any]:
    return {
        "url": rt.url,
        "models": list(rt.models),
        "weight": rt.config.weight,
        "circuit": rt.breaker.state.name.lower(),
        "last_error": rt.last_error,
        "kvroute_backend_healthy": int(rt.routable),
        "kvroute_backend_draining": int(rt.draining),
        "kvroute_backend_circuit_state": int(rt.breaker.state),
        "kvroute_backend_in_flight_requests": fs.in_flight_requests if fs else None,
        "kvroute_backend_in_flight_tokens": fs.in_flight_tokens if fs else None,
        "kvroute_backend_engine_running": eng.num_running if eng else None,
        "kvroute_backend_engine_waiting": eng.num_waiting if eng else None,
        "kvroute_backend_engine_kv_usage": eng.kv_cache_usage if eng else None,
        "kvroute_backend_engine_prefix_hits_tokens": eng.prefix_cache_hits if eng else None,
        "kvroute_backend_engine_prefix_queries_tokens": (eng.prefix_cache_queries if eng else None),
        "kvroute_backend_predicted_hit_rate": _ratio(
            fs.predicted_hit_tokens, fs.predicted_query_tokens
        )
        if fs
        else None,
        "kvroute_backend_measured_hit_rate": _ratio(fs.engine_hit_tokens, fs.engine_query_tokens)
        if fs
        else None,
        "kvroute_backend_index_blocks": fs.index_blocks if fs else None,
        "kvroute_backend_hot_blocks": fs.hot_blocks if fs else None,
    }


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f} %"
    return html.escape(str(value))


# status page columns: (header, row key, as a percentage)
_COLUMNS = (
    ("circuit", "circuit", False),
    ("mode", "mode", False),
    ("in flight", "kvroute_backend_in_flight_requests", False),
    ("ours", "kvroute_backend_router_in_flight_requests", False),
    ("queue", "kvroute_backend_engine_waiting", False),
    ("KV usage", "kvroute_backend_engine_kv_usage", True),
    ("index blocks", "kvroute_backend_index_blocks", False),
    ("hot blocks", "kvroute_backend_hot_blocks", False),
    ("KV events", "kvroute_backend_kv_events", False),
    ("event lag s", "kvroute_backend_kv_lag_seconds", False),
    ("gaps", "kvroute_backend_kv_gaps", False),
    ("speculative", "kvroute_backend_speculative_blocks", False),
    ("predicted hit", "kvroute_backend_predicted_hit_rate", True),
    ("measured hit", "kvroute_backend_measured_hit_rate", True),
    ("reported hit", "kvroute_backend_reported_hit_rate", True),
    ("predicted (same)", "kvroute_backend_reported_predicted_hit_rate", True),
)


def _cell(value: Any, pct: bool) -> str:
    if isinstance(value, float) and not pct:
        value = f"{value:.3f}"
    return f"<td>{_fmt(value, pct)}</td>"


async def handle_status_page(request: web.Request) -> web.Response:
    """A small HTML page that refreshes itself: one row per backend."""
    state = request.app[STATE]
    rows = backend_rows(state)
    cells = []
    for r in rows:
        health = (
            "draining"
            if r["kvroute_backend_draining"]
            else ("healthy" if r["kvroute_backend_healthy"] else "down")
        )
        cells.append(
            f"<tr><td>{html.escape(r['url'])}</td><td>{health}</td>"
            + "".join(_cell(r.get(key), pct) for _, key, pct in _COLUMNS)
            + f"<td>{html.escape(', '.join(r['models']))}</td></tr>"
        )
    headers = "".join(f"<th>{h}</th>" for h, _, _ in _COLUMNS)
    page = _PAGE.format(
        policy=html.escape(state.config.policy),
        mode=html.escape(state.fleet.config.mode),
        healthy=state.backends.num_routable,
        total=len(rows),
        in_flight=state.num_in_flight,
        headers=headers,
        rows="\n".join(cells) or f'<tr><td colspan="{len(_COLUMNS) + 3}">no backends</td></tr>',
    )
    return web.Response(text=page, content_type="text/html")


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>kvroute</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}
</style></head><body>
<h1>kvroute</h1>
<p>policy <b>{policy}</b> &middot; mode <b>{mode}</b> &middot; {healthy}/{total} backends
healthy &middot; {in_flight} requests in flight</p>
<table><tr><th>backend</th><th>health</th>{headers}<th>models</th></tr>
{rows}
</table>
<p>in flight: merged with the engine's gauges; ours: this router's own. predicted hit: over
all dispatches; measured: the engine's prefix-cache counters; reported: the engine's
cached_tokens in responses; predicted (same): the router's prediction for those responses.
</p></body></html>
"""
