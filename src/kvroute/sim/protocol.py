"""OpenAI/vLLM request validation and response shapes for the simulated engine.

No I/O here: ``parse_request`` turns a decoded JSON body into a ``SimRequest`` or raises
``ApiError`` (vLLM's error body and status); the ``*_chunk`` / ``*_response`` builders
return the dicts vLLM sends, field for field.

Differences from vLLM, on purpose: a completions ``prompt`` may be a batch of exactly
one prompt (a bigger batch is a 400), ``n`` must be 1, and chat's default ``max_tokens``
is 16 like completions (vLLM's is "the rest of the context", far too long for a
simulator). Sampling parameters (temperature, top_p, stop, ...) are accepted and ignored:
output is a deterministic word sequence that always ends by length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.common.chat import ChatFormatError, render_chat
from kvroute.common.tokenizer import VOCAB_SIZE, Tokenizer

DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """A request the server refuses; ``body()`` is vLLM's error JSON."""

    def __init__(
        self, message: str, *, status: int = 400, type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        # vLLM's ErrorResponse: OpenAI's envelope, ``code`` the HTTP status as a number
        # (before 2025 vLLM answered the same fields flat, with "object": "error")
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A validated completion or chat request."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    prompt_token_ids: list[int]  # what the engine prefills
    max_tokens: int  # output tokens to generate, >= 1
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream: a final chunk with usage
    continuous_usage: bool  # stream: usage in every chunk
    seed: int  # picks the output words; equal requests give equal outputs
    cache_salt: str | None  # vLLM's cache_salt: isolates this request's prefix cache


def parse_request(
    body: Any, *, chat: bool, model_name: str, max_model_len: int, tokenizer: Tokenizer
) -> SimRequest:
    """Validate a decoded JSON body the way vLLM does; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        if not isinstance(model, str):
            raise ApiError("'model' must be a string", param="model")
        raise ApiError(
            f"The model `{model}` does not exist.", status=404, type_="NotFoundError",
            param="model",
        )  # fmt: skip
    ids = prompt_ids(body, chat, tokenizer)
    max_tokens = _max_tokens(body, chat)
    _check_length(len(ids), max_tokens, max_model_len)
    stream = _optional_bool(body, "stream")
    include_usage, continuous = _stream_options(body.get("stream_options"), stream)
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError("the simulator supports only n=1", param="n")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError("'seed' must be an integer", param="seed")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("'cache_salt' must be a non-empty string", param="cache_salt")
    return SimRequest(
        chat=chat,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        seed=hash(tuple(ids)) if seed is None else seed,
        cache_salt=salt,
    )


def prompt_ids(body: dict[str, Any], chat: bool, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: the rendered chat, the prompt text, or the given ids."""
    return _chat_ids(body, tokenizer) if chat else _completion_ids(body.get("prompt"), tokenizer)


def _chat_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    if "messages" not in body:
        raise ApiError("'messages' is required", param="messages")
    try:
        text = render_chat(body["messages"], body.get("tools"))
    except ChatFormatError as exc:
        raise ApiError(str(exc), param="messages") from None
    return tokenizer.encode(text)


def _completion_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                f"the simulator serves one prompt per request, got a batch of {len(prompt)}",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("Prompt cannot be empty", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError("Prompt cannot be empty", param="prompt")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ApiError("'prompt' token ids must be integers", param="prompt")
            if not 0 <= t < VOCAB_SIZE:
                raise ApiError(f"Token id {t} is out of vocabulary", param="prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    raise ApiError(
        "'prompt' must be a string, a list of token ids, or a list of one of these",
        param="prompt",
    )


def _max_tokens(body: dict[str, Any], chat: bool) -> int:
    """The decode cap as vLLM reads it: a chat's ``max_completion_tokens`` wins over its
    ``max_tokens`` (both checked); a completion has only ``max_tokens``."""
    cap = DEFAULT_MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ApiError(f"'{key}' must be an integer", param=key)
        if value < 1:
            raise ApiError(f"{key} must be at least 1, got {value}.", param=key)
        cap = value
    return cap


def _check_length(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt} input tokens. Please reduce the length of the input "
            "messages.",
            param="messages",
        )
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {max_model_len} tokens and your request has "
            f"{num_prompt} input tokens ({max_tokens} > {max_model_len} - {num_prompt}).",
            param="max_tokens",
        )


def _optional_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"'{key}' must be a boolean", param=key)
    return value


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    include = _optional_bool(options, "include_usage")
    continuous = _optional_bool(options, "continuous_usage_stats")
    return include, continuous


def usage(num_prompt: int, num_output: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "total_tokens": num_prompt + num_output,
        "completion_tokens": num_output,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def stream_chunk(
    rid: str, created: int, model: str, chat: bool, text: str, finish_reason: str | None,
    *, role: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One SSE chunk carrying ``text`` (chat: the first one may carry the role only)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict[str, Any]) -> dict:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}  # fmt: skip


def full_response(
    rid: str, created: int, model: str, chat: bool, text: str, finish_reason: str,
    use: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The non-streaming answer."""
    if chat:
        message = {"role": "assistant", "content": text, "reasoning_content": None,
                   "tool_calls": []}  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": finish_reason, "stop_reason": None}  # fmt: skip
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": use, "prompt_logprobs": None}  # fmt: skip
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": None, "prompt_logprobs": None}  # fmt: skip
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": use}  # fmt: skip
