"""Does a live router hold what the engines' KV events say? An independent follower.

``EventFollower`` subscribes to every engine's KV events from seq 0 (its own thread and
event loop, off the load generator's) into an exact-mode Fleet of its own. After a run,
``view_check`` compares the router's ``GET /admin/kv`` with it, per backend: held
(confirmed) block count and a digest of the keys. Equal rows mean the router applied
every event (that the event view equals the engine's own block set is the subscriber's
own test). In approximate mode only the block counts are shown side by side.

Used by ``kvroute.bench.exact_vs_approx`` (reported per run) and by the tests
(asserted, tests/exact/test_router_view.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from kvroute.bench.procs import SimEngine
from kvroute.core.config import FleetConfig
from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.router.kv_subscriber import KvEventSubscriber

T = TypeVar("T")
View = dict[str, dict[str, Any]]  # backend URL -> what the follower holds for it


class EventFollower:
    """Follows every engine's KV events in a thread of its own (module doc)."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.fleet = Fleet(make_policy("round_robin"), FleetConfig(mode="exact"))
        for e in engines:
            self.fleet.add_backend(e.url)
        events = {e.url: e.kv_events for e in engines if e.kv_events}
        replay = {e.url: e.kv_replay for e in engines if e.kv_replay}
        self.sub = KvEventSubscriber(self.fleet, events, replay)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def start(self) -> None:
        self.thread.start()
        self._call(self.sub.start())

    def stop(self) -> None:
        self._call(self.sub.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def snapshot(self) -> View:
        """Per backend: exact or not, last seq applied, gaps, held blocks and their digest."""

        async def snap() -> View:
            out = {}
            for url in self.fleet.urls():
                keys = self.fleet.confirmed_keys(url)  # None: approximate
                status = self.sub.status(url)
                out[url] = {
                    "exact": keys is not None,
                    "last_seq": status.last_seq if status else None,
                    "gaps": status.num_gaps if status else None,
                    "blocks": len(keys) if keys is not None else None,
                    "digest": str(sum(keys) % 2**64) if keys is not None else None,
                }
            return out

        return self._call(snap())


async def admin_kv(router_url: str, admin_key: str) -> dict[str, Any]:
    """The router's ``GET /admin/kv``."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
        s.get(router_url + "/admin/kv", headers=headers) as r,
    ):
        return await r.json()  # type: ignore[no-any-return]


async def wait_exact(router_url: str, admin_key: str, timeout_s: float = 30) -> None:
    """Until the router follows every backend's events (mode "exact" in /admin/kv)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = (await admin_kv(router_url, admin_key))["backends"]
        if rows and all(r["mode"] == "exact" for r in rows):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("router did not sync every backend's KV events in time")


async def settled_views(
    router_url: str, admin_key: str, follower: EventFollower, exact: bool, timeout_s: float = 20
) -> tuple[dict[str, Any], View]:
    """Router and follower views once both applied the same last batch (exact), or once
    the follower stopped moving (approximate), or when time is up."""
    deadline = time.monotonic() + timeout_s
    prev: View | None = None
    while True:
        kv = await admin_kv(router_url, admin_key)
        snap = await asyncio.to_thread(follower.snapshot)
        seqs = {u: v["last_seq"] for u, v in snap.items()}
        if exact:
            same = all(r["kv_last_seq"] == seqs.get(r["url"]) for r in kv["backends"])
        else:
            same = prev is not None and seqs == {u: v["last_seq"] for u, v in prev.items()}
        if same or time.monotonic() > deadline:
            return kv, snap
        prev = snap
        await asyncio.sleep(0.5)


def view_check(kv: dict[str, Any], snap: View, exact: bool) -> dict[str, Any]:
    """The comparison: totals, ``backends_equal`` ("k/n" in exact mode), per backend
    [blocks, digest, last seq] of router and follower, and the router's predictions."""
    rows = {r["url"]: r for r in kv["backends"]}
    out: dict[str, Any] = {"engine_blocks": sum(v["blocks"] or 0 for v in snap.values())}
    if exact:
        match = [
            rows[u]["confirmed_blocks"] == v["blocks"]
            and rows[u]["confirmed_digest"] == v["digest"]
            for u, v in snap.items()
        ]
        out["router_blocks"] = sum(r["confirmed_blocks"] or 0 for r in rows.values())
        out["backends_equal"] = f"{sum(match)}/{len(match)}"
        out["speculative_blocks"] = sum(r["speculative_blocks"] or 0 for r in rows.values())
    else:
        out["router_blocks"] = sum(r["index_blocks"] for r in rows.values())
        out["backends_equal"] = "n/a (text keys)"
    n = sum(r["num_reported"] for r in rows.values())
    out["pred_exact_share"] = sum(r["num_reported_exact"] for r in rows.values()) / n if n else None
    out["per_backend"] = {
        u: {
            "router": [
                rows[u]["confirmed_blocks"],
                rows[u]["confirmed_digest"],
                rows[u]["kv_last_seq"],
            ],
            "engine": [v["blocks"], v["digest"], v["last_seq"]],
        }
        for u, v in snap.items()
    }
    hit = sum(r["reported_hit_tokens"] for r in rows.values())
    pred = sum(r["reported_predicted_tokens"] for r in rows.values())
    out["predicted_over_reported"] = pred / hit if hit else None
    return out
