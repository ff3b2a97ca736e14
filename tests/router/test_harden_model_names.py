"""Client-chosen model names: bounded, and never cached per name by the Fleet (issue 9,
finding 5).
"""

from __future__ import annotations

import json

import pytest

from kvroute.router.config import LimitConfig
from kvroute.router.errors import BadRequest
from kvroute.router.request import parse_completion
from tests.router.conftest import Harness
from tests.router.harden_request_helpers import (
    assert_bad_request,
    assert_still_serves,
    dead_url,
)

# -- finding 5: per-model caches and client-chosen names --------------------------------


async def test_unknown_model_names_leave_the_fleet_caches_bounded(harness: Harness) -> None:
    """A backend down since start has no model list, so any name might be served: each
    distinct name used to add entries to three per-model caches of the Fleet."""
    b = await harness.backend("a")
    client = await harness.router([b.url, dead_url()])
    fleet = harness.state(client).fleet
    for i in range(300):
        resp = await client.post("/v1/completions", json={"model": f"name-{i}", "prompt": "x"})
        assert resp.status == 503  # only the dead backend could serve such a name
    served = fleet._served
    caches = (served.model_to_eligible, served.model_to_block_size, served.model_to_key_kind)
    assert all(len(c) <= 3 for c in caches), [len(c) for c in caches]
    await assert_still_serves(client)


async def test_model_name_length_and_characters_are_bounded(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url, dead_url()])
    resp = await client.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "x"})
    await assert_bad_request(resp, "256")
    resp = await client.post("/v1/completions", json={"model": "\x00all", "prompt": "x"})
    await assert_bad_request(resp, "control")
    resp = await client.post("/v1/completions", json={"model": "m" * 256, "prompt": "x"})
    assert resp.status == 503  # as long as allowed: unknown, and only the dead one might serve it
    await assert_still_serves(client)


def test_model_name_limit_is_configurable() -> None:
    """``limits.max_model_name_chars`` (the proxy passes it to the parser)."""
    raw = json.dumps({"model": "m" * 300, "prompt": "x"}).encode()
    with pytest.raises(BadRequest, match="256"):
        parse_completion(raw, chat=False)
    assert parse_completion(raw, chat=False, max_model_name_chars=300).model == "m" * 300
    assert LimitConfig().max_model_name_chars == 256
    with pytest.raises(ValueError, match="max_model_name_chars"):
        LimitConfig(max_model_name_chars=0)
