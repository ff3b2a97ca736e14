"""Parse and check a completion request body once; the bytes are forwarded unchanged.

Every number the router reads is bounded here, with a 400 naming the field: the load
counters do arithmetic on them, and a client's 10**308 once overflowed it (issue 9).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.core.keys import Prompt, PromptError, prompt_of
from kvroute.router.body import json_error
from kvroute.router.errors import BadRequest

_decode = msgspec.json.Decoder().decode

# max_tokens assumed when the client sends none (OpenAI completions default is 16;
# chat has no cap, so a typical answer length stands in for the load estimate)
DEFAULT_MAX_TOKENS = {False: 16, True: 256}
# Largest max_tokens taken when no model card gives the context (``Backends.check_context``
# applies that one): above every released model's context (10M), far below overflow.
MAX_TOKENS_CAP = 1 << 24
# "model" names longer than this get 400 (limits.max_model_name_chars; route_request passes it)
DEFAULT_MAX_MODEL_NAME_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # no served model's name holds these
# Deepest nesting of arrays and objects a body may have: real tool schemas stay well under
# it; ~1,000 levels make the decoder (or any recursive walk after it) raise RecursionError.
MAX_JSON_DEPTH = 128


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the router needs from a body; the body itself travels as the original bytes."""

    model: str | None  # None: the client sent none (routed if one model is served)
    stream: bool  # SSE response expected
    prompt: Prompt  # routing text or token ids
    max_tokens: int  # the client's cap, or DEFAULT_MAX_TOKENS
    max_tokens_field: str | None = None  # the field the client set it with; None: default


def parse_completion(
    raw: bytes, *, chat: bool, max_model_name_chars: int = DEFAULT_MAX_MODEL_NAME_CHARS
) -> ParsedRequest:
    """BadRequest (400) naming the field for anything a backend would refuse as malformed."""
    return parse_completion_body(raw, chat=chat, max_model_name_chars=max_model_name_chars)[0]


def parse_completion_body(
    raw: bytes, *, chat: bool, max_model_name_chars: int = DEFAULT_MAX_MODEL_NAME_CHARS
) -> tuple[ParsedRequest, dict[str, Any]]:
    """``parse_completion`` plus the decoded body (a real model's chat template needs it)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    body = _decode_checked(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        _check_model(model, max_model_name_chars)
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
    max_tokens, field = _max_tokens(body, chat)
    return ParsedRequest(model, stream, prompt, max_tokens, field), body


def _decode_checked(raw: bytes) -> Any:
    """The decoded body, or BadRequest when it is not JSON or nests deeper than
    MAX_JSON_DEPTH. The walk runs only when the bracket count allows such a depth."""
    try:
        body = _decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise json_error("request body", raw, exc) from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> BadRequest:
    return BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")


def _nests_deeper(body: Any, limit: int) -> bool:
    """True when arrays and objects in ``body`` nest more than ``limit`` deep. Iterative,
    one level at a time; a container of scalars (a token-id list) is passed over at C speed."""
    level, depth = [body], 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            kinds = set(map(type, children))
            if list in kinds or dict in kinds:
                below.extend(c for c in children if type(c) is list or type(c) is dict)
        level, depth = below, depth + 1
    return False


def _max_tokens(body: dict[str, Any], chat: bool) -> tuple[int, str | None]:
    """(the decode cap, the field that set it), as vLLM reads it: a chat's
    ``max_completion_tokens`` wins over its ``max_tokens`` (both checked); a completion
    has only ``max_tokens`` (vLLM ignores the other there)."""
    found: tuple[int, str | None] = (DEFAULT_MAX_TOKENS[chat], None)
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer")
        if value > MAX_TOKENS_CAP:  # never echoed: str() of a 5,000-digit int raises
            raise BadRequest(f"'{name}' must be at most {MAX_TOKENS_CAP}")
        found = (value, name)
    return found


def _check_model(model: Any, max_chars: int) -> None:
    """A name that could be served: it keys routing state until it is refused, so its
    length is bounded and it holds no control characters."""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    if len(model) > max_chars:
        raise BadRequest(f"'model' must be at most {max_chars} characters")
    if _CONTROL.search(model):
        raise BadRequest("'model' must not contain control characters")
