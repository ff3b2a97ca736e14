"""The stream assembler alone: SSE bytes in, one whole answer out (router/assemble.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.router.assemble import (
    AssemblyError,
    StreamAssembler,
    assembly_blocker,
    stream_body,
)


def sse(*events: dict[str, Any] | str, crlf: bool = False) -> bytes:
    out = b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )
    return out.replace(b"\n", b"\r\n") if crlf else out


def chunk(choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": choices,
        **top,
    }


def assemble(data: bytes, chat: bool = True, step: int | None = None) -> dict[str, Any]:
    a = StreamAssembler(chat, 1 << 20)
    if step is None:
        a.feed(data)
    else:
        for i in range(0, len(data), step):
            a.feed(data[i : i + step])
    return a.answer()


USAGE = {
    "prompt_tokens": 9,
    "total_tokens": 12,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 0},
}

TOOL_STREAM = sse(
    chunk(
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call-a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                },
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call-b",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": '{"tz"'},
                        }
                    ]
                },
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {"index": 0, "function": {"name": "get_weather", "arguments": '"Paris"}'}}
                    ]
                },
            }
        ]
    ),
    chunk(
        [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 1, "function": {"arguments": ': "UTC"}'}}]},
            }
        ]
    ),
    chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]),
    chunk([], usage=USAGE),
    "[DONE]",
)


def test_tool_calls_are_assembled_by_their_index_with_arguments_concatenated() -> None:
    answer = assemble(TOOL_STREAM)
    assert answer["object"] == "chat.completion"
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None  # only tool calls came
    assert message["tool_calls"] == [
        {
            "id": "call-a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call-b",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
        },
    ]
    assert answer["usage"] == USAGE


def test_chunk_boundaries_and_crlf_do_not_matter() -> None:
    whole = assemble(TOOL_STREAM)
    assert assemble(TOOL_STREAM, step=1) == whole
    assert assemble(TOOL_STREAM, step=7) == whole
    crlf = TOOL_STREAM.replace(b"\n", b"\r\n")
    assert assemble(crlf, step=3) == whole


def test_chat_answer_has_the_whole_answer_shape_and_order() -> None:
    data = sse(
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        ),
        chunk([{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}]),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "lo"},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ]
        ),
        chunk([], usage=USAGE),
        "[DONE]",
    )
    answer = assemble(data)
    assert json.dumps(answer) == json.dumps(
        {
            "id": "chatcmpl-7",
            "object": "chat.completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "Hello",
                        "reasoning_content": None,
                        "tool_calls": [],
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "usage": USAGE,
            "prompt_logprobs": None,
        }
    )


def test_n_choices_reasoning_and_logprobs_are_kept_apart_by_index() -> None:
    def lp(token: str) -> dict[str, Any]:
        return {"content": [{"token": token, "logprob": -0.5, "bytes": None, "top_logprobs": []}]}

    data = sse(
        chunk(
            [
                {"index": 1, "delta": {"role": "assistant", "content": ""}},
                {"index": 0, "delta": {"role": "assistant", "content": ""}},
            ]
        ),
        chunk([{"index": 0, "delta": {"reasoning_content": "think "}, "logprobs": lp("think")}]),
        chunk([{"index": 1, "delta": {"content": "B"}, "logprobs": lp("B")}]),
        chunk([{"index": 0, "delta": {"reasoning_content": "more"}, "logprobs": lp("more")}]),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "A"},
                    "logprobs": lp("A"),
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 1,
                    "delta": {"content": "b"},
                    "logprobs": lp("b"),
                    "finish_reason": "stop",
                    "stop_reason": 7,
                }
            ]
        ),
        "[DONE]",
    )
    answer = assemble(data)
    first, second = answer["choices"]
    assert first["index"] == 0 and second["index"] == 1
    assert first["message"]["content"] == "A"
    assert first["message"]["reasoning_content"] == "think more"
    assert [t["token"] for t in first["logprobs"]["content"]] == ["think", "more", "A"]
    assert second["message"] == {
        "role": "assistant",
        "content": "Bb",
        "reasoning_content": None,
        "tool_calls": [],
    }
    assert [t["token"] for t in second["logprobs"]["content"]] == ["B", "b"]
    assert (first["finish_reason"], second["finish_reason"]) == ("length", "stop")
    assert second["stop_reason"] == 7
    assert "usage" not in answer  # the engine sent none


def test_completion_logprobs_lists_concatenate() -> None:
    def c(text: str, offset: int, finish: str | None) -> dict[str, Any]:
        logprobs = {
            "text_offset": [offset],
            "token_logprobs": [-1.0],
            "tokens": [text],
            "top_logprobs": [{text: -1.0}],
        }
        return {
            "id": "cmpl-3",
            "object": "text_completion",
            "created": 2,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
            ],
        }

    data = sse(
        c(" a", 0, None),
        c(" b", 2, "length"),
        {**c("", 0, None), "choices": [], "usage": USAGE},
        "[DONE]",
    )
    answer = assemble(data, chat=False)
    assert answer["object"] == "text_completion"
    (choice,) = answer["choices"]
    assert choice["text"] == " a b"
    assert choice["logprobs"] == {
        "text_offset": [0, 2],
        "token_logprobs": [-1.0, -1.0],
        "tokens": [" a", " b"],
        "top_logprobs": [{" a": -1.0}, {" b": -1.0}],
    }
    assert list(choice) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_logprobs",
    ]
    assert answer["usage"] == USAGE


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            sse({"error": {"message": "engine died", "type": "x", "code": 500}}, "[DONE]"),
            "engine died",
        ),
        (sse({"object": "error", "message": "old style", "code": 400}), "old style"),
        (b"data: {not json\n\n", "not JSON"),
        (sse("[1, 2]"), "not a JSON object"),
        (sse(chunk([{"delta": {"content": "x"}}])), "index"),
        (sse(chunk([{"index": 0, "delta": {"content": "x"}}])), "before \\[DONE\\]"),
    ],
)
def test_what_cannot_become_an_answer_raises(data: bytes, message: str) -> None:
    a = StreamAssembler(True, 1 << 20)
    with pytest.raises(AssemblyError, match=message):
        a.feed(data)
        a.answer()


def test_what_it_holds_is_bounded() -> None:
    a = StreamAssembler(True, 1000)
    with pytest.raises(AssemblyError, match="over 1000 bytes"):
        for _ in range(200):
            a.feed(sse(chunk([{"index": 0, "delta": {"content": "0123456789"}}])))
    b = StreamAssembler(True, 1000)
    with pytest.raises(AssemblyError, match="event over 1000 bytes"):
        b.feed(b"data: " + b"x" * 2000)  # no end of event in sight


def test_bytes_after_done_are_ignored_and_comments_skipped() -> None:
    a = StreamAssembler(False, 1 << 20)
    a.feed(
        b": keep-alive\n\n"
        + sse(
            {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]},
            "[DONE]",
        )
        + b"data: junk\n\n"
    )
    assert a.answer()["choices"][0]["text"] == "x"


@pytest.mark.parametrize(
    ("body", "chat", "blocker"),
    [
        ({"prompt": "a", "echo": True}, False, "echo"),
        ({"prompt": "a", "best_of": 2}, False, "best_of"),
        ({"messages": [], "prompt_logprobs": 1}, True, "prompt_logprobs"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, False, "stream_options"),
        ({"prompt": ["a", "b"]}, False, "prompt"),
        ({"prompt": [[1, 2], [3]]}, False, "prompt"),
        ({"prompt": ["a"]}, False, None),
        ({"prompt": [1, 2, 3]}, False, None),
        ({"prompt": "a", "echo": False, "n": 3, "logprobs": 2}, False, None),
        ({"messages": [], "tools": [], "logprobs": True, "top_logprobs": 3}, True, None),
    ],
)
def test_blockers(body: dict[str, Any], chat: bool, blocker: str | None) -> None:
    assert assembly_blocker(body, chat) == blocker


def test_stream_body_asks_for_usage_and_keeps_the_rest() -> None:
    body = {"model": "m", "stream": False, "prompt": "hi", "max_tokens": 3}
    assert json.loads(stream_body(body)) == {
        "model": "m",
        "stream": True,
        "prompt": "hi",
        "max_tokens": 3,
        "stream_options": {"include_usage": True},
    }
