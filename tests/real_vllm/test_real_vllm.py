"""kvroute in front of two real vLLM CPU engines (opt-in: KVROUTE_REAL_VLLM=1).

Runs scripts/real_vllm/e2e.py once (two engines, 72 chat requests per mode, streaming
and non-streaming clients) and checks what the engines' own counters say, for both kinds
of client: routing by prefix gets a higher prefix-cache hit rate than round-robin,
nothing fails, in exact mode the router's view of each engine equals what that engine's
KV events say it holds, and a salted request is predicted (and gets) a hit only after a
request with the same ``cache_salt``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "scripts" / "real_vllm" / "e2e.py"
REQUESTS = 72
CLIENTS = pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The JSON of one e2e run (engines start once: minutes)."""
    out = tmp_path_factory.mktemp("real_vllm") / "e2e.json"
    argv = [sys.executable, str(E2E), "--requests", str(REQUESTS), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout)
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def by_kind(e2e: dict[str, Any]) -> dict[bool, dict[str, dict[str, Any]]]:
    """streaming? -> mode -> ModeResult as JSON."""
    out: dict[bool, dict[str, dict[str, Any]]] = {True: {}, False: {}}
    for r in e2e["results"]:
        out[r["stream"]][r["mode"]] = r
    return out


def _assert_clean(r: dict[str, Any]) -> None:
    assert r["status"] == "ok", r["status"]
    assert r["failures"] == 0
    assert r["requests"] == REQUESTS
    assert r["hit_rate"] is not None


@CLIENTS
@pytest.mark.timeout(2000)
def test_prefix_routing_beats_round_robin(
    by_kind: dict[bool, dict[str, dict[str, Any]]], stream: bool
) -> None:
    results = by_kind[stream]
    rr, approx = results["round_robin"], results["approx"]
    _assert_clean(rr)
    _assert_clean(approx)
    assert approx["hit_rate"] > rr["hit_rate"]


@CLIENTS
@pytest.mark.timeout(2000)
def test_exact_mode_matches_engine_events(
    by_kind: dict[bool, dict[str, dict[str, Any]]], stream: bool
) -> None:
    results = by_kind[stream]
    exact, rr = results["exact"], results["round_robin"]
    if exact["status"].startswith("TODO"):
        pytest.skip(exact["status"])
    _assert_clean(exact)
    assert exact["hit_rate"] > rr["hit_rate"]
    assert exact["view_matches_events"], exact["engines"]


@pytest.mark.timeout(2000)
def test_cache_salt_is_keyed_as_vllm_keys_it(e2e: dict[str, Any]) -> None:
    salt = e2e["salt"]
    if salt is None:
        pytest.skip("exact mode did not run")
    steps = [(st["salt"], st["decision"], st["hit_tokens"] > 0) for st in salt["steps"]]
    assert steps == [
        ("tenant-a", "cold", False),
        (None, "cold", False),  # same system prompt, no salt: vLLM misses, so must we
        ("tenant-a", "prefix", True),
    ]
