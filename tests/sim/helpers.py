"""Small client helpers shared by the sim tests."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
]


def long_prompt(tag: str, num_words: int) -> str:
    """A prompt of about ``num_words`` tokens that differs from any other tag's from the start."""
    return tag + " " + " ".join(WORDS[i % len(WORDS)] + str(i % 7) for i in range(num_words))


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def stream_events(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE answer (``"[DONE]"`` kept as a string)."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client: sample name (+labels) -> value."""
    async with session.get(base + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
