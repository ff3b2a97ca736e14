"""One non-streaming answer built from the engine's stream (the stream-assisted relay).

A whole answer carries no first token: the router would see only its end, learn a
prefill rate from the whole generation time, and count the prompt as queued prefill
until the last token. So for a non-streaming client the router asks a vLLM engine for a
stream with ``stream_options.include_usage``, learns the first-token time from the first
chunk exactly as for a streaming client, and answers ONE JSON body built here from the
chunks, shaped as the engine's own non-streaming answer:

- top level: ``id``, ``object`` (``chat.completion.chunk`` -> ``chat.completion``;
  ``text_completion`` stays), ``created``, ``model``, ``choices`` (by ``index``), any other
  field the chunks carry (last non-null value), ``usage`` (the usage chunk's, with
  ``prompt_tokens_details`` when present); chat adds ``prompt_logprobs: null``;
- a chat choice: ``index``, ``message`` (``role``, ``content`` and every other string
  field of the deltas concatenated, e.g. ``reasoning_content``; ``reasoning_content: null``
  when no reasoning came; ``tool_calls`` assembled by their own index: id, type, name,
  ``arguments`` concatenated; ``content`` is null when only tool calls came), ``logprobs``
  (each list concatenated), ``finish_reason``, ``stop_reason``;
- a completion choice: ``index``, ``text`` (concatenated), ``logprobs`` (each list, e.g.
  ``tokens``, ``text_offset``, concatenated), ``finish_reason``, ``stop_reason``,
  ``prompt_logprobs: null``.

The ``null`` defaults are what vLLM (and the simulator) put in a whole answer for the
requests assembled here: requests that ask for what a stream cannot give back the same
way (``assembly_blocker``) are forwarded as they came. An error event in the stream, an
event that is not JSON, or a stream without ``[DONE]`` is an ``AssemblyError``: the
client, which was sent nothing yet, gets a 502.

Pure: bytes in, a dict out; the relay does the I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

# request fields whose answer a stream does not give back the same way (or that vLLM
# refuses or treats differently with "stream": true); a truthy value keeps the request
# from being assembled
_BLOCKING_FIELDS = (
    "best_of",  # several candidates generated, one returned: vLLM streams differently
    "echo",  # the prompt is part of the text and of the logprobs
    "prompt_logprobs",  # a whole answer's field, not a stream's
    "stream_options",  # vLLM refuses it without "stream": the client's error stays its own
    "return_token_ids",  # prompt and output ids are laid out differently in chunks
    "use_beam_search",  # vLLM does not stream beam search
    "kv_transfer_params",  # disaggregated prefill: the answer carries the engine's params
    "functions",  # legacy function calling: "function_call" deltas, not tool calls
    "function_call",
)
TOOL_CALL_FIELDS = ("id", "type", "function")


class AssemblyError(Exception):
    """The stream cannot become an answer (an error event, bad JSON, cut, too big)."""


def assembly_blocker(body: dict[str, Any], chat: bool) -> str | None:
    """The field that keeps ``body`` from being assembled from a stream, or None."""
    for name in _BLOCKING_FIELDS:
        if body.get(name):
            return name
    prompt = body.get("prompt")
    # a batch: the choices of several prompts, usage summed over them
    is_batch = isinstance(prompt, list) and len(prompt) > 1 and type(prompt[0]) is not int
    return "prompt" if not chat and is_batch else None


def stream_body(body: dict[str, Any]) -> bytes:
    """``body`` asking for a stream whose last chunk carries the usage."""
    return _encode({**body, "stream": True, "stream_options": {"include_usage": True}})


class _Choice:
    """What the chunks said of one choice so far."""

    __slots__ = ("fields", "finish_reason", "logprobs", "other", "role", "stop_reason",
                 "tool_calls")  # fmt: skip

    def __init__(self) -> None:
        self.role: str | None = None
        # delta (chat) or choice (completion) string fields -> their pieces, in first-seen
        # order: "content", "reasoning_content", "text", ...
        self.fields: dict[str, list[str]] = {}
        self.other: dict[str, Any] = {}  # other fields: lists concatenated, else last value
        self.tool_calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its parts
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: Any = None
        self.stop_reason: Any = None

    def text_of(self, key: str) -> str | None:
        parts = self.fields.get(key)
        return None if parts is None else "".join(parts)


class StreamAssembler:
    """Feed it the SSE bytes of one chat or completion stream; ``answer`` builds the body.

    ``max_kept_bytes`` bounds what it holds (text, arguments, logprob events): the same
    cap as a whole answer's (``limits.max_response_bytes``). Incremental: a chunk may end
    anywhere, even inside an event.
    """

    def __init__(self, chat: bool, max_kept_bytes: int) -> None:
        self.chat = chat
        self.max_kept_bytes = max_kept_bytes
        self.kept_bytes = 0
        self.done = False  # "data: [DONE]" seen
        self.num_events = 0  # data events decoded (the [DONE] excluded)
        self.usage: dict[str, Any] | None = None
        self._buf = b""
        self._top: dict[str, Any] = {}  # id, object, created, model, then other fields
        self._choices: dict[int, _Choice] = {}

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream; AssemblyError as soon as it cannot work."""
        if self.done:
            return  # nothing counts after [DONE]
        buf = self._buf + data
        if b"\r" in buf:  # CRLF framing; a lone trailing \r waits for its \n
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        if len(self._buf) > self.max_kept_bytes:
            raise AssemblyError(f"a stream event over {self.max_kept_bytes} bytes")
        for event in events:
            self._event(event)
            if self.done:
                return

    def _event(self, event: bytes) -> None:
        lines = [x[5:] for x in event.split(b"\n") if x.startswith(b"data:")]
        if not lines:
            return  # a comment or a keep-alive
        payload = b"\n".join(x[1:] if x.startswith(b" ") else x for x in lines)
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            obj = _decode(payload)
        except (msgspec.DecodeError, RecursionError):
            raise AssemblyError("the stream sent an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise AssemblyError("the stream sent an event that is not a JSON object")
        _raise_on_error(obj)
        self.num_events += 1
        self._merge(obj, len(payload))

    def _merge(self, obj: dict[str, Any], size: int) -> None:
        top = self._top
        for key, value in obj.items():
            if key == "choices":
                if not isinstance(value, list):
                    raise AssemblyError("a stream chunk's 'choices' is not a list")
                for choice in value:
                    self._merge_choice(choice, size)
            elif key == "usage":
                if isinstance(value, dict):
                    self.usage = value
            elif key in ("id", "object", "created", "model"):
                top.setdefault(key, value)
            elif value is not None or key not in top:
                top[key] = value
        if self.kept_bytes > self.max_kept_bytes:
            raise AssemblyError(f"the answer is over {self.max_kept_bytes} bytes")

    def _merge_choice(self, c: Any, size: int) -> None:
        if not isinstance(c, dict) or type(c.get("index")) is not int or c["index"] < 0:
            raise AssemblyError("a stream choice has no valid 'index'")
        state = self._choices.get(c["index"])
        if state is None:
            state = self._choices[c["index"]] = _Choice()
        for key, value in c.items():
            if key == "index":
                continue
            if key == "delta":
                self._merge_delta(state, value)
            elif key == "text":
                self._add_text(state, key, value)
            elif key == "logprobs":
                if value is not None:
                    state.logprobs = _merge_lists(state.logprobs, value, "logprobs")
                    self.kept_bytes += size  # its entries are as big as their JSON
            elif key == "finish_reason":
                state.finish_reason = value if value is not None else state.finish_reason
            elif key == "stop_reason":
                state.stop_reason = value if value is not None else state.stop_reason
            else:
                _merge_other(state.other, key, value)

    def _merge_delta(self, state: _Choice, delta: Any) -> None:
        if delta is None:
            return
        if not isinstance(delta, dict):
            raise AssemblyError("a stream choice's 'delta' is not an object")
        for key, value in delta.items():
            if key == "role":
                if state.role is None and isinstance(value, str):
                    state.role = value
            elif key == "tool_calls":
                self._merge_tool_calls(state, value)
            elif isinstance(value, str):
                self._add_text(state, key, value)
            elif value is not None:
                _merge_other(state.other, key, value)

    def _add_text(self, state: _Choice, key: str, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise AssemblyError(f"a stream chunk's '{key}' is not a string")
        state.fields.setdefault(key, []).append(value)
        self.kept_bytes += len(value)

    def _merge_tool_calls(self, state: _Choice, calls: Any) -> None:
        if calls is None:
            return
        if not isinstance(calls, list):
            raise AssemblyError("a stream delta's 'tool_calls' is not a list")
        for call in calls:
            if not isinstance(call, dict):
                raise AssemblyError("a stream tool call is not an object")
            index = call.get("index")
            if type(index) is not int:  # some engines leave it out: the call in progress
                index = max(state.tool_calls, default=0)
            parts = state.tool_calls.setdefault(index, {"name": None, "arguments": []})
            for key in ("id", "type"):
                if parts.get(key) is None and call.get(key) is not None:
                    parts[key] = call[key]
            function = call.get("function")
            if function is None:
                continue
            if not isinstance(function, dict):
                raise AssemblyError("a stream tool call's 'function' is not an object")
            name = function.get("name")
            if parts["name"] is None and name:  # sent once; some engines repeat it
                parts["name"] = name
            arguments = function.get("arguments")
            if arguments is not None:
                if not isinstance(arguments, str):
                    raise AssemblyError("a stream tool call's 'arguments' is not a string")
                parts["arguments"].append(arguments)
                self.kept_bytes += len(arguments)

    def answer(self) -> dict[str, Any]:
        """The whole answer; AssemblyError if the stream did not end with [DONE]."""
        if not self.done:
            raise AssemblyError("the stream ended before [DONE]")
        top = self._top
        out: dict[str, Any] = {k: top[k] for k in ("id", "object", "created", "model") if k in top}
        if out.get("object") == "chat.completion.chunk":
            out["object"] = "chat.completion"
        choices = [self._choice(i, self._choices[i]) for i in sorted(self._choices)]
        out["choices"] = choices
        for key, value in top.items():
            out.setdefault(key, value)
        if self.usage is not None:
            out["usage"] = self.usage
        if self.chat:
            out["prompt_logprobs"] = None
        return out

    def _choice(self, index: int, s: _Choice) -> dict[str, Any]:
        if not self.chat:
            choice: dict[str, Any] = {"index": index, "text": s.text_of("text") or ""}
            choice.update(logprobs=s.logprobs, finish_reason=s.finish_reason,
                          stop_reason=s.stop_reason)  # fmt: skip
            choice.update(s.other)
            choice["prompt_logprobs"] = None
            return choice
        return {"index": index, "message": _message(s), "logprobs": s.logprobs,
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                **s.other}  # fmt: skip


def _message(s: _Choice) -> dict[str, Any]:
    """A chat choice's ``message`` from its deltas (see the module docstring)."""
    calls = [_tool_call(s.tool_calls[i]) for i in sorted(s.tool_calls)]
    content = s.text_of("content")
    if calls and content == "":
        content = None  # vLLM and OpenAI: a tool-calling answer without text has no content
    message: dict[str, Any] = {"role": s.role or "assistant", "content": content}
    for key in s.fields:
        if key != "content":
            message[key] = s.text_of(key)
    if "reasoning_content" not in message and "reasoning" not in message:
        message["reasoning_content"] = None
    message["tool_calls"] = calls
    return message


def _tool_call(parts: dict[str, Any]) -> dict[str, Any]:
    function = {"name": parts["name"], "arguments": "".join(parts["arguments"])}
    return {"id": parts.get("id"), "type": parts.get("type") or "function", "function": function}


def _merge_lists(into: dict[str, Any] | None, value: Any, name: str) -> dict[str, Any]:
    """``value``'s lists appended to ``into``'s (logprobs chunks); other fields replace."""
    if not isinstance(value, dict):
        raise AssemblyError(f"a stream chunk's '{name}' is not an object")
    out = {} if into is None else into
    for key, item in value.items():
        if isinstance(item, list) and isinstance(out.get(key), list):
            out[key].extend(item)
        elif isinstance(item, list):
            out[key] = list(item)
        elif item is not None or key not in out:
            out[key] = item
    return out


def _merge_other(other: dict[str, Any], key: str, value: Any) -> None:
    """A field without its own rule: lists concatenate, anything else keeps its last value."""
    if isinstance(value, list) and isinstance(other.get(key), list):
        other[key].extend(value)
    elif value is not None or key not in other:
        other[key] = list(value) if isinstance(value, list) else value


def _raise_on_error(obj: dict[str, Any]) -> None:
    """AssemblyError carrying the engine's message when ``obj`` is an error event (vLLM
    sends ``{"error": {...}}``; older versions ``{"object": "error", "message": ...}``)."""
    error = obj.get("error")
    if error is None and obj.get("object") != "error":
        return
    detail = error if isinstance(error, dict) else obj
    message = detail.get("message") if isinstance(detail, dict) else error
    text = str(message)[:300] if message else "no message"
    raise AssemblyError(f"the engine reported an error mid-answer: {text}")
