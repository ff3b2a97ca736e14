"""The granian floor's RSGI app forwards like the aiohttp floor (granian itself not needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiohttp.test_utils import TestServer

from kvroute.bench.fake_backend import FakeState, make_fake_app
from kvroute.bench.perf.bare_proxy_rsgi import App


@dataclass
class Scope:  # the fields of granian's RSGI scope the app reads
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    proto: str = "http"


class Protocol:  # granian's RSGI HTTP protocol: the body by await, one response call
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.responses: list[tuple[int, list[tuple[str, str]], bytes]] = []

    async def __call__(self) -> bytes:
        return self.body

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.responses.append((status, headers, body))


async def test_posts_go_to_each_backend_in_turn_and_answers_come_back_whole() -> None:
    states = [FakeState(name=name, model="m") for name in ("a", "b")]
    servers = [TestServer(make_fake_app(state)) for state in states]
    for server in servers:
        await server.start_server()
    app = App([str(s.make_url("")).rstrip("/") for s in servers])
    try:
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
        for _ in range(2):
            protocol = Protocol(body)
            scope = Scope("POST", "/v1/completions", {"content-type": "application/json"})
            await app.__rsgi__(scope, protocol)
            ((status, headers, answer),) = protocol.responses
            assert status == 200 and ("content-type", "application/json") in headers
            assert json.loads(answer)["choices"][0]["text"].startswith("echo:hello")
        assert [len(state.requests) for state in states] == [1, 1]
        health = Protocol(b"")
        await app.__rsgi__(Scope("GET", "/health"), health)
        assert health.responses[0][0] == 200
    finally:
        if app._session is not None:
            await app._session.close()
        for server in servers:
            await server.close()
