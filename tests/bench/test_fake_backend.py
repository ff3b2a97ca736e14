"""The canned backend the router-cost benchmarks run (``python -m kvroute.bench.fake_backend``)."""

from __future__ import annotations

import json

from aiohttp.test_utils import TestClient, TestServer

from kvroute.bench.fake_backend import CANNED_CHAT, CANNED_COMPLETION, make_canned_app


async def test_canned_backend_answers_every_endpoint_the_router_calls() -> None:
    async with TestClient(TestServer(make_canned_app())) as client:
        completion = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert await completion.read() == CANNED_COMPLETION
        assert await chat.read() == CANNED_CHAT
        assert json.loads(CANNED_CHAT)["choices"][0]["message"]["content"] == "ok"
        models = await (await client.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == ["m"]
        assert (await client.get("/health")).status == 200
