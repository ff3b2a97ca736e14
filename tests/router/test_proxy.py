"""Proxying: bodies identical to direct, headers, streaming, model-aware routing."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import aiohttp

from tests.router.conftest import Harness

BODY = b'{"model": "m1", "prompt": "hello world", "max_tokens": 4}'
STREAM_BODY = b'{"model": "m1", "prompt": "hello world", "stream": true}'


async def _direct(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, await r.read()


async def test_non_streaming_body_and_status_identical_to_direct(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    status, direct = await _direct(b.url, "/v1/completions", BODY)
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == status == 200
    assert await resp.read() == direct
    assert resp.headers["x-kvroute-backend"] == b.url
    assert resp.headers["x-kvroute-decision"] == "round_robin"
    assert resp.headers["x-backend"] == "a"  # backend headers pass through
    assert len(resp.headers["x-request-id"]) >= 16
    # the original bytes went upstream, not a re-serialisation
    assert b.state.requests[-1]["body"] == BODY


async def test_streaming_chunks_identical_to_direct(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    _, direct = await _direct(b.url, "/v1/chat/completions", STREAM_BODY)
    resp = await client.post(
        "/v1/chat/completions",
        data=b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert await resp.read() == direct
    assert direct.endswith(b"data: [DONE]\n\n")


async def test_request_id_echoed_and_replaced_upstream(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.post("/v1/completions", data=BODY, headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    # the engine gets the router's id: clients' ids may collide (issue 9, finding 12)
    assert b.state.requests[-1]["headers"]["x-request-id"] != "abc-123"


async def test_round_robin_spreads_and_model_aware_routing(harness: Harness) -> None:
    a1 = await harness.backend("a1", model="m1")
    a2 = await harness.backend("a2", model="m1")
    c = await harness.backend("c", model="m2")
    client = await harness.router([a1.url, a2.url, c.url])
    seen = set()
    for _ in range(6):
        resp = await client.post("/v1/completions", data=BODY)
        assert resp.status == 200
        seen.add(resp.headers["x-kvroute-backend"])
    assert seen == {a1.url, a2.url}
    resp = await client.post("/v1/completions", data=b'{"model": "m2", "prompt": "x"}')
    assert resp.status == 200
    assert resp.headers["x-kvroute-backend"] == c.url


async def test_unknown_model_is_404(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.post("/v1/completions", data=b'{"model": "nope", "prompt": "x"}')
    assert resp.status == 404
    body = await resp.json()
    assert body["error"]["code"] == "model_not_found"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert not b.state.requests


async def test_missing_model_uses_the_only_model(harness: Harness) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.post("/v1/completions", data=b'{"prompt": "x"}')
    assert resp.status == 200


async def test_models_union_over_healthy_backends(harness: Harness) -> None:
    a = await harness.backend("a", model="m1")
    c = await harness.backend("c", model="m2")
    client = await harness.router([a.url, c.url])
    resp = await client.get("/v1/models")
    ids = [m["id"] for m in (await resp.json())["data"]]
    assert ids == ["m1", "m2"]


async def test_backend_4xx_passed_through_not_retried(harness: Harness) -> None:
    b = await harness.backend("a")
    b.state.fail_status = 400
    client = await harness.router([b.url])
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 400
    assert len(b.state.requests) == 1


async def test_a_lora_adapter_never_shares_prefix_keys_with_its_base_model(
    harness: Harness,
) -> None:
    """vLLM keys an adapter's KV blocks with its name: a prompt cached for the adapter is
    no hit for the base model (and the other way round), so the router keys them apart."""
    backends = [await harness.backend(n) for n in ("a", "b")]
    for b in backends:
        b.state.adapters = ("sql-lora",)
    client = await harness.router([b.url for b in backends], policy="prefix")
    prompt = "You translate questions into SQL for the sales schema. " * 12

    async def decision(model: str, question: str) -> str:
        body = {"model": model, "prompt": prompt + question, "max_tokens": 2}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        return resp.headers["x-kvroute-decision"]

    assert harness.state(client).backends.adapters == {"sql-lora"}
    assert await decision("sql-lora", "one") == "cold"
    assert await decision("m1", "two") == "cold"  # same text, base model: other keys
    assert await decision("sql-lora", "three") == "prefix"
    assert await decision("m1", "four") == "prefix"


class _RecordingTokenizer:
    """A real-model tokenizer stand-in: records the thread each call ran on."""

    off_loop = True

    def __init__(self) -> None:
        self.threads: list[str] = []

    def start(self, body: dict[str, Any], chat: bool) -> _Recorded:
        return _Recorded(self, len(body["prompt"]))  # all new: nothing cached


@dataclasses.dataclass
class _Recorded:
    tokenizer: _RecordingTokenizer
    new_chars: int

    def finish(self) -> list[int]:
        self.tokenizer.threads.append(threading.current_thread().name)
        return [7] * (self.new_chars // 4)


async def test_a_real_tokenizer_runs_off_the_event_loop_for_long_prompts(
    harness: Harness,
) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url], policy="prefix", mode="exact")
    tokenizer = _RecordingTokenizer()
    harness.state(client).model_to_tokenizer["m1"] = tokenizer
    loop_thread = threading.current_thread().name
    for prompt in ("short prompt", "long prompt " * 2_000):
        resp = await client.post("/v1/completions", json={"model": "m1", "prompt": prompt})
        assert resp.status == 200
    assert tokenizer.threads[0] == loop_thread  # a thread hop costs more than it saves
    assert tokenizer.threads[1] != loop_thread
