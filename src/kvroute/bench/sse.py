"""Server-sent events of OpenAI streaming responses, parsed without a socket.

``SseDecoder.feed(bytes)`` returns the ``data:`` payloads completed by those bytes (a
payload may arrive split over reads); ``read_chunk(payload)`` says what one payload
carries. The load generator times each payload on arrival; tests feed raw bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SseDecoder:
    """Incremental ``data:`` line extractor; comments, other fields and blank lines are skipped."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if line.startswith("data:"):
                out.append(line[5:].lstrip(" "))
        return out

    def flush(self) -> list[str]:
        """Payload of a last line that had no newline (some servers end that way)."""
        rest, self._buffer = self._buffer, b""
        return self.feed(rest + b"\n") if rest.strip() else []


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one streamed payload carries."""

    text: str  # generated text in this chunk ("" when none)
    has_token: bool  # carries generated text: counts for TTFT / ITL
    prompt_tokens: int | None  # from usage, when present
    completion_tokens: int | None  # from usage, when present
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when present
    error: str | None  # an error object sent inside the stream
    done: bool  # the "[DONE]" sentinel


def _usage_fields(usage: Any) -> tuple[int | None, int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached


def read_chunk(payload: str) -> Chunk:
    """Interpret one ``data:`` payload of a completions or chat-completions stream (or a
    whole non-streaming answer: a chat answer's ``message`` reads as a ``delta``)."""
    if payload.strip() == DONE:
        return Chunk("", False, None, None, None, None, True)
    try:
        data = json.loads(payload)
    except ValueError:
        return Chunk("", False, None, None, None, f"bad stream payload: {payload[:200]}", False)
    if not isinstance(data, dict):
        return Chunk("", False, None, None, None, "stream payload is not an object", False)
    if "error" in data:
        err = data["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        return Chunk("", False, None, None, None, str(message), False)
    text = ""
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta", choice.get("message"))
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text = choice.get("text") or ""
    prompt, completion, cached = _usage_fields(data.get("usage"))
    return Chunk(text, bool(text), prompt, completion, cached, None, False)
