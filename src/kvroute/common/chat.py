"""The deterministic chat template shared by the simulator and the router.

``render_chat`` turns an OpenAI ``messages`` list (and optional ``tools``) into the
prompt text the simulated engine tokenizes. The router renders the same text to compute
its routing keys, so a request's keys match the engine's cached prefix. The format puts
tools first and then each message in order, so a shared system prompt (and shared
conversation history) is a shared text prefix.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import xxhash

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


_encode_sorted = msgspec.json.Encoder(order="sorted").encode


class ChatFormatError(ValueError):
    """A ``messages`` or ``tools`` value that does not follow the OpenAI schema."""


def content_text(content: Any, where: str) -> str:
    """The text of a message's ``content``: a string, a list of parts, or null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise ChatFormatError(f"{where}.content[{i}] must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatFormatError(f"{where}.content[{i}].text must be a string")
                texts.append(text)
            else:
                # a non-text part (an image, audio) stands as its type and a digest of
                # the part: two different images are two prompts, as in the engine's
                # cache (vLLM keys such blocks by the media's hash too)
                digest = xxhash.xxh3_64_hexdigest(_encode_sorted(part))
                texts.append(f"<{part['type']}:{digest}>")
        return "".join(texts)
    raise ChatFormatError(f"{where}.content must be a string, a list of parts or null")


def render_chat(messages: object, tools: object = None) -> str:
    """Render ``messages`` (and ``tools``) to prompt text ending with the assistant cue.

    Both are a request body's decoded JSON, whatever the client sent: they are checked
    here, and ChatFormatError names the offending field.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    out: list[str] = []
    if tools:
        if not isinstance(tools, list):
            raise ChatFormatError("'tools' must be a list")
        spec = json.dumps(tools, sort_keys=True, separators=(",", ":"))
        out.append(f"<|tools|>\n{spec}\n")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatFormatError(f"{where} must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list is not even hashable
            raise ChatFormatError(f"{where}.role must be one of {sorted(ROLES)}")
        text = content_text(msg.get("content"), where)
        calls = msg.get("tool_calls")
        if calls:
            text += "\n<|tool_calls|>" + json.dumps(calls, sort_keys=True, separators=(",", ":"))
        out.append(f"<|{role}|>\n{text}\n")
    out.append("<|assistant|>\n")
    return "".join(out)
