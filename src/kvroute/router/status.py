"""One row of facts per backend, shared by the status page, /admin/backends and /metrics."""

from __future__ import annotations

import html
from typing import Any

from aiohttp import web

from kvroute.router.state import STATE, RouterState


def backend_rows(state: RouterState) -> list[dict[str, Any]]:
    """Facts per backend; keys match the BackendCollector gauge names plus a few texts."""
    fleet_states = {s.url: s for s in state.fleet.backend_states()}
    rows = []
    for rt in state.backends:
        fs = fleet_states.get(rt.url)
        eng = rt.engine
        rows.append(
            {
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
                "kvroute_backend_engine_prefix_queries_tokens": (
                    eng.prefix_cache_queries if eng else None
                ),
                "kvroute_backend_predicted_hit_rate": _ratio(
                    fs.predicted_hit_tokens, fs.predicted_query_tokens
                )
                if fs
                else None,
                "kvroute_backend_measured_hit_rate": _ratio(
                    fs.engine_hit_tokens, fs.engine_query_tokens
                )
                if fs
                else None,
                "kvroute_backend_index_blocks": fs.index_blocks if fs else None,
            }
        )
    return rows


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f} %"
    return html.escape(str(value))


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
            "<tr>"
            f"<td>{html.escape(r['url'])}</td><td>{health}</td><td>{r['circuit']}</td>"
            f"<td>{_fmt(r['kvroute_backend_in_flight_requests'])}</td>"
            f"<td>{_fmt(r['kvroute_backend_engine_waiting'])}</td>"
            f"<td>{_fmt(r['kvroute_backend_engine_kv_usage'], True)}</td>"
            f"<td>{_fmt(r['kvroute_backend_predicted_hit_rate'], True)}</td>"
            f"<td>{_fmt(r['kvroute_backend_measured_hit_rate'], True)}</td>"
            f"<td>{html.escape(', '.join(r['models']))}</td>"
            "</tr>"
        )
    page = _PAGE.format(
        policy=html.escape(state.config.policy),
        healthy=state.backends.num_routable,
        total=len(rows),
        in_flight=state.num_in_flight,
        rows="\n".join(cells) or '<tr><td colspan="9">no backends</td></tr>',
    )
    return web.Response(text=page, content_type="text/html")


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>kvroute</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}
</style></head><body>
<h1>kvroute</h1>
<p>policy <b>{policy}</b> &middot; {healthy}/{total} backends healthy &middot;
{in_flight} requests in flight</p>
<table><tr><th>backend</th><th>health</th><th>circuit</th><th>in flight</th>
<th>queue</th><th>KV usage</th><th>predicted hit</th><th>measured hit</th><th>models</th></tr>
{rows}
</table></body></html>
"""
