"""Parse and check a completion request body once; the bytes are forwarded unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.core.keys import Prompt, PromptError, prompt_of
from kvroute.router.errors import BadRequest

_decode = msgspec.json.Decoder().decode

# max_tokens assumed when the client sends none (OpenAI completions default is 16;
# chat has no cap, so a typical answer length stands in for the load estimate)
DEFAULT_MAX_TOKENS = {False: 16, True: 256}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the router needs from a body; the body itself travels as the original bytes."""

    model: str | None  # None: the client sent none (routed if one model is served)
    stream: bool  # SSE response expected
    prompt: Prompt  # routing text or token ids
    max_tokens: int  # the client's cap, or DEFAULT_MAX_TOKENS


def parse_completion(raw: bytes, *, chat: bool) -> ParsedRequest:
    """BadRequest (400) naming the field for anything a backend would refuse as malformed."""
    return parse_completion_body(raw, chat=chat)[0]


def parse_completion_body(raw: bytes, *, chat: bool) -> tuple[ParsedRequest, dict[str, Any]]:
    """``parse_completion`` plus the decoded body (a real model's chat template needs it)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    if chat and "messages" not in body:
        raise BadRequest("'messages' is required")
    if not chat and "prompt" not in body:
        raise BadRequest("'prompt' is required")
    try:
        prompt = prompt_of(body, chat)
    except PromptError as exc:
        raise BadRequest(str(exc)) from None
    return ParsedRequest(model, stream, prompt, _max_tokens(body, chat)), body


def _max_tokens(body: dict[str, Any], chat: bool) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer")
        return value
    return DEFAULT_MAX_TOKENS[chat]
