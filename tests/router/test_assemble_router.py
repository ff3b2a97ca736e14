"""Non-streaming clients of a vLLM engine get an answer assembled from its stream (issue 10).

Real HTTP on loopback: the router in front of a scripted vLLM-like backend
(tests/router/assemble_helpers.py). What the router sends upstream, what the client
gets back, and what the Fleet learned (first token, queued prefill, cached tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvroute.router.cli import add_parser, config_from_args
from kvroute.router.config import RouterConfig, TimeoutConfig, config_from_mapping
from tests.conftest import until
from tests.router.assemble_helpers import VllmLike, sse, text_stream
from tests.router.conftest import Harness

PROMPT = "Summarise the following text. " * 40  # ~1,200 characters: ~300 tokens estimated
CHAT = {"model": "m1", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
USAGE = {
    "prompt_tokens": 310,
    "total_tokens": 313,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 256},
}


@pytest.fixture
async def vllm(harness: Harness) -> AsyncIterator[VllmLike]:
    """Torn down before the harness checks that nothing leaked."""
    backend = await VllmLike().start()
    yield backend
    await backend.close()


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def test_non_streaming_chat_is_asked_as_a_stream_and_answered_whole(
    harness: Harness, vllm: VllmLike
) -> None:
    vllm.script.events = text_stream(["Hel", "lo", "!"], USAGE, chat=True)
    client = await harness.router([vllm.url])
    resp = await client.post("/v1/chat/completions", data=_raw(CHAT))
    assert resp.status == 200
    assert resp.headers.getall("Content-Type") == ["application/json"]
    assert resp.headers["x-kvroute-backend"] == vllm.url
    answer = await resp.json()
    assert answer == {
        "id": "x-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello!",
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": USAGE,
        "prompt_logprobs": None,
    }
    sent = json.loads(vllm.script.bodies[-1])
    assert sent == {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    assert vllm.script.headers[-1]["accept-encoding"] == "identity"
    (bs,) = harness.state(client).fleet.backend_states()
    assert (bs.num_reported, bs.reported_hit_tokens) == (1, 256)  # usage read from the stream


async def test_tool_call_deltas_become_message_tool_calls(harness: Harness, vllm: VllmLike) -> None:
    top = {"id": "x-2", "object": "chat.completion.chunk", "created": 1, "model": "m1"}

    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**top, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    call = {
        "index": 0,
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "lookup", "arguments": ""},
    }
    vllm.script.events = sse(
        delta({"role": "assistant", "content": ""}),
        delta({"tool_calls": [call]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": "kv'}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": ' cache"}'}}]}),
        delta({}, finish="tool_calls"),
        {**top, "choices": [], "usage": USAGE},
        "[DONE]",
    )
    client = await harness.router([vllm.url])
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "lookup"}}]}
    resp = await client.post("/v1/chat/completions", data=_raw(body))
    assert resp.status == 200
    (choice,) = (await resp.json())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "kv cache"}'},
        }
    ]


async def test_queued_prefill_is_released_at_the_first_token_of_a_non_streaming_request(
    harness: Harness, vllm: VllmLike
) -> None:
    s = vllm.script
    s.events = text_stream(["a", "b", "c"], USAGE, chat=False)
    s.hold_first, s.hold_rest = asyncio.Event(), asyncio.Event()
    client = await harness.router([vllm.url])
    fleet = harness.state(client).fleet
    body = {"model": "m1", "prompt": PROMPT, "max_tokens": 3}
    task = asyncio.ensure_future(client.post("/v1/completions", data=_raw(body)))
    await until(lambda: len(s.bodies) == 1)
    (before,) = fleet.backend_states()
    assert before.in_flight_requests == 1 and before.queued_prefill_tokens > 0
    s.hold_first.set()  # the first token
    await until(lambda: fleet.backend_states()[0].queued_prefill_tokens == 0)
    assert fleet.backend_states()[0].in_flight_requests == 1  # the answer is still going
    s.hold_rest.set()
    resp = await task
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == "abc"


async def test_streaming_clients_are_relayed_as_before(harness: Harness, vllm: VllmLike) -> None:
    vllm.script.events = text_stream(["x", "y"], USAGE, chat=False)
    client = await harness.router([vllm.url])
    raw = _raw({"model": "m1", "prompt": PROMPT, "stream": True})
    resp = await client.post("/v1/completions", data=raw)
    assert await resp.read() == b"".join(vllm.script.events)
    assert vllm.script.bodies[-1] == raw  # the client's own bytes


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
async def test_usage_is_read_from_a_relayed_stream_whatever_its_line_ends(
    harness: Harness, vllm: VllmLike, eol: bytes
) -> None:
    """SSE lets an engine end lines with LF, CRLF or CR: the usage chunk counts in each."""
    events = text_stream(["x", "y"], USAGE, chat=False)
    vllm.script.events = [e.replace(b"\n", eol) for e in events]
    client = await harness.router([vllm.url])
    body = {"model": "m1", "prompt": PROMPT, "stream": True}
    raw = _raw({**body, "stream_options": {"include_usage": True}})
    resp = await client.post("/v1/completions", data=raw)
    assert await resp.read() == b"".join(vllm.script.events)  # relayed as it came
    (bs,) = harness.state(client).fleet.backend_states()
    assert (bs.num_reported, bs.reported_hit_tokens) == (1, 256)


@pytest.mark.parametrize(
    ("body", "owned_by", "config"),
    [
        ({"model": "m1", "prompt": PROMPT, "echo": True}, "vllm", {}),
        ({"model": "m1", "prompt": PROMPT, "best_of": 2}, "vllm", {}),
        ({"model": "m1", "prompt": [PROMPT, PROMPT]}, "vllm", {}),
        ({"model": "m1", "prompt": PROMPT}, "sglang", {}),  # another engine's card
        ({"model": "m1", "prompt": PROMPT}, "vllm", {"assemble_non_streaming": False}),
    ],
)
async def test_what_is_not_assembled_goes_as_it_came_and_teaches_no_rate(
    harness: Harness, vllm: VllmLike, body: dict[str, Any], owned_by: str, config: dict[str, Any]
) -> None:
    vllm.script.owned_by = owned_by
    vllm.script.gap_s = 0.05  # were its end taken for a first token, a rate sample
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 16}}  # 284 tokens of work
    vllm.script.whole = {"id": "cmpl-9", "object": "text_completion", "choices": [], "usage": usage}
    client = await harness.router([vllm.url], **config)
    raw = _raw(body)
    resp = await client.post("/v1/completions", data=raw)
    assert resp.status == 200
    assert await resp.json() == vllm.script.whole
    assert vllm.script.bodies[-1] == raw
    (bs,) = harness.state(client).fleet.backend_states()
    assert bs.rate_samples == 0  # the whole answer's time is not a first token
    assert (bs.num_reported, bs.reported_hit_tokens) == (1, 16)  # its usage still counts


async def test_an_error_event_in_the_stream_is_a_502_json(harness: Harness, vllm: VllmLike) -> None:
    top = {"id": "x-3", "object": "text_completion", "created": 1, "model": "m1"}
    vllm.script.events = sse(
        {**top, "choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}},
        "[DONE]",
    )
    client = await harness.router([vllm.url])
    resp = await client.post("/v1/completions", data=_raw({"model": "m1", "prompt": PROMPT}))
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert "engine dead" in error["message"] and error["code"] == "backend_failed"
    assert harness.state(client).fleet.backend_states()[0].num_failed == 1


async def test_a_cut_stream_is_a_502_and_a_slow_one_a_504(harness: Harness, vllm: VllmLike) -> None:
    vllm.script.events = text_stream(["a", "b", "c", "d"], USAGE, chat=False)
    vllm.script.drop_after = 2
    client = await harness.router([vllm.url], timeouts=TimeoutConfig(response_s=0.3))
    body = _raw({"model": "m1", "prompt": PROMPT})
    resp = await client.post("/v1/completions", data=body)
    assert resp.status == 502
    assert "answer cut" in (await resp.json())["error"]["message"]
    vllm.script.drop_after = None
    vllm.script.gap_s = 0.2  # four events: 0.8 s, over response_s
    resp = await client.post("/v1/completions", data=body)
    assert resp.status == 504
    assert "timeouts.response_s" in (await resp.json())["error"]["message"]


async def test_an_engine_error_to_the_stream_request_passes_through(
    harness: Harness, vllm: VllmLike
) -> None:
    vllm.script.status = 400
    client = await harness.router([vllm.url])
    resp = await client.post("/v1/completions", data=_raw({"model": "m1", "prompt": PROMPT}))
    assert resp.status == 400
    assert (await resp.json())["message"] == "refused"
    assert harness.state(client).fleet.backend_states()[0].rate_samples == 0


def _serve_config(*flags: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["serve", "--backend", "http://h:1", *flags]))


def test_assembly_is_on_by_default_and_can_be_turned_off() -> None:
    assert RouterConfig().assemble_non_streaming is True
    assert _serve_config().assemble_non_streaming is True
    assert _serve_config("--no-assemble-non-streaming").assemble_non_streaming is False
    assert config_from_mapping({"assemble_non_streaming": False}).assemble_non_streaming is False
    with pytest.raises(ValueError, match="assemble_non_streaming"):
        config_from_mapping({"assemble_non_streaming": "no"})
