"""The OpenAI surface of a simulated backend, shaped like vLLM's answers."""

from __future__ import annotations

from kvroute.common.chat import render_chat
from kvroute.common.tokenizer import default_tokenizer
from tests.sim.helpers import post, stream_events

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]


async def test_completion_has_vllm_shape_and_usage(fleet, session):
    url = fleet.urls[0]
    body = {"model": "tiny", "prompt": "Say hello to the world", "max_tokens": 5}
    status, body = await post(session, url + "/v1/completions", body)
    assert status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(default_tokenizer().encode(choice["text"])) == 5
    usage = body["usage"]
    num_prompt = len(default_tokenizer().encode("Say hello to the world"))
    assert usage["prompt_tokens"] == num_prompt
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == num_prompt + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_same_request_gives_same_text_and_default_max_tokens_is_16(fleet, session):
    url = fleet.urls[0] + "/v1/completions"
    _, a = await post(session, url, {"prompt": "repeat me"})
    _, b = await post(session, url, {"prompt": "repeat me"})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 16


async def test_prompt_may_be_token_ids_or_a_batch_of_one(fleet, session):
    url = fleet.urls[0] + "/v1/completions"
    for prompt in ([101, 102, 103], [[101, 102, 103]], ["text prompt"]):
        status, body = await post(session, url, {"prompt": prompt, "max_tokens": 2})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens"] == len(default_tokenizer().encode("text prompt"))


async def test_streaming_completion_one_token_per_chunk_then_usage_and_done(fleet, session):
    events = await stream_events(session, fleet.urls[0] + "/v1/completions", {
        "prompt": "stream this", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip
    assert events[-1] == "[DONE]"
    tokens, usage = events[:4], events[4]
    assert len(events) == 6
    ids = {e["id"] for e in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for e in tokens:
        assert e["object"] == "text_completion" and e["model"] == "tiny"
        assert len(default_tokenizer().encode(e["choices"][0]["text"])) == 1
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_streaming_without_usage_ends_with_last_token_then_done(fleet, session):
    events = await stream_events(session, fleet.urls[1] + "/v1/completions",
                                 {"prompt": "x y z", "max_tokens": 2, "stream": True})  # fmt: skip
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert "usage" not in events[1] and events[1]["choices"][0]["finish_reason"] == "length"


async def test_chat_completion_counts_the_rendered_template(fleet, session):
    status, body = await post(session, fleet.urls[0] + "/v1/chat/completions",
                              {"model": "tiny", "messages": CHAT, "max_tokens": 3})  # fmt: skip
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(default_tokenizer().encode(choice["message"]["content"])) == 3
    assert body["usage"]["prompt_tokens"] == len(default_tokenizer().encode(render_chat(CHAT)))


async def test_a_chats_max_completion_tokens_wins_and_a_completion_reads_max_tokens(fleet, session):
    """vLLM's reading: ``max_completion_tokens or max_tokens`` for a chat; a completion
    has no max_completion_tokens (vLLM ignores the field there)."""
    chat = {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 5}
    status, body = await post(session, fleet.urls[0] + "/v1/chat/completions", chat)
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    plain = {"prompt": "x y", "max_tokens": 2, "max_completion_tokens": 0}
    status, body = await post(session, fleet.urls[0] + "/v1/completions", plain)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_streaming_chat_sends_role_first_then_content_deltas(fleet, session):
    events = await stream_events(session, fleet.urls[0] + "/v1/chat/completions", {
        "messages": CHAT, "max_completion_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip
    assert events[-1] == "[DONE]"
    role, *deltas, usage, _ = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(deltas) == 3
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert all(set(e["choices"][0]["delta"]) == {"content"} for e in deltas)
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 3


async def test_continuous_usage_puts_usage_in_every_chunk(fleet, session):
    events = await stream_events(session, fleet.urls[0] + "/v1/completions", {
        "prompt": "abc", "max_tokens": 3, "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    })  # fmt: skip
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]


async def test_models_health_version_and_tokenize(fleet, session):
    url = fleet.urls[1]
    async with session.get(url + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [("tiny", 8192)]
    async with session.get(url + "/health") as resp:
        assert resp.status == 200
    async with session.get(url + "/version") as resp:
        assert "version" in await resp.json()
    status, body = await post(session, url + "/tokenize", {"prompt": "hello world"})
    assert status == 200 and body["tokens"] == default_tokenizer().encode("hello world")
    assert body["count"] == len(body["tokens"])
