"""The bare proxy (router_cost's floor) forwards bodies and answers unchanged, in turn."""

from __future__ import annotations

import aiohttp
from aiohttp.test_utils import TestServer

from kvroute.bench.fake_backend import FakeState, make_fake_app
from kvroute.bench.perf.bare_proxy import make_app


async def test_it_forwards_to_each_backend_in_turn() -> None:
    states = [FakeState(name=name, model="m") for name in ("a", "b")]
    backends = [TestServer(make_fake_app(state)) for state in states]
    for server in backends:
        await server.start_server()
    proxy = TestServer(make_app([str(s.make_url("")).rstrip("/") for s in backends]))
    await proxy.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            answers = []
            for _ in range(2):
                body = {"model": "m", "prompt": "hello", "max_tokens": 1}
                async with session.post(proxy.make_url("/v1/completions"), json=body) as resp:
                    assert resp.status == 200
                    answers.append(await resp.json())
        assert all(a["choices"][0]["text"].startswith("echo:hello") for a in answers)
        assert [len(state.requests) for state in states] == [1, 1]
    finally:
        await proxy.close()
        for server in backends:
            await server.close()
