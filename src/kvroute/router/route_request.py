"""From a client's completion request to the ``RouteRequest`` the Fleet decides on.

The body is parsed once (router/request.py) and checked against the models the backends
serve; the request gets an id of the router's own for the engine; its prompt becomes
block keys: the engine's token ids while the model is routed on KV events (exact keys),
else text keys with a token estimate from the text's bytes (core/keys.py,
core/token_keys.py). Big bodies are parsed and keyed in a thread, so the loop keeps
answering meanwhile. The session hint (a configured header, or the body's ``user``)
tells the Fleet where the session's last request went (core/sessions.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from aiohttp import web

from kvroute.common.hashing import chain_seed
from kvroute.core.keys import Prompt, PromptError, prompt_block_hashes, salt_of, text_route_keys
from kvroute.core.policy.base import RouteRequest
from kvroute.core.token_keys import (
    PendingIds,
    PromptTokenizer,
    exact_route_keys,
    prompt_token_ids,
)
from kvroute.router.clients import client_address
from kvroute.router.config import SessionConfig
from kvroute.router.errors import BadRequest, ModelNotFound, NoHealthyBackend
from kvroute.router.request import parse_completion_body
from kvroute.router.state import BUILTIN_TOKENIZER, NOTE, RouterState

# the request path's logger (the proxy logs under it too)
log = logging.getLogger("kvroute.router.requests")
# below this much new text a thread hop (~50-100 us) costs more than tokenizing in place
OFF_LOOP_MIN_CHARS = 8_192
# a body this big is parsed and keyed in a thread (built-in tokenizer or text keys), so
# the loop keeps answering meanwhile (a 4 MiB prompt: ~0.5 s of tokenizing). Pure Python
# holds the GIL, but the loop gets it back every 5 ms (sys.getswitchinterval; the
# tokenizer's regex runs in slices for that), so below ~3 ms of work (64 KiB of text) a
# thread would give nothing back
OFF_LOOP_KEYS_BYTES = 65_536
# a session hint longer than this, or with a control character, is no hint (not an error)
MAX_SESSION_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class _RequestIds:
    """Ids unique across processes and restarts: 8 random bytes per process (drawn again
    in a forked child) and a counter. One ``os.urandom`` per request cost a syscall."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)

    def new(self) -> str:
        return f"{self.prefix}{next(self.counter):08x}"


_IDS = _RequestIds()


def new_request_id() -> str:
    return _IDS.new()


async def route_request(
    state: RouterState, request: web.Request, raw: bytes, *, chat: bool
) -> tuple[RouteRequest, bool, dict[str, Any], int | None]:
    """(what the Fleet routes on, whether the client asked for a stream, the body, the
    UTF-8 bytes of the one text prompt keyed as text: None for token keys or a batch)."""
    name_chars = state.config.limits.max_model_name_chars
    if len(raw) >= OFF_LOOP_KEYS_BYTES:
        parsed, body = await asyncio.to_thread(
            parse_completion_body, raw, chat=chat, max_model_name_chars=name_chars
        )
    else:
        parsed, body = parse_completion_body(raw, chat=chat, max_model_name_chars=name_chars)
    model = parsed.model
    if model is None:
        model = state.backends.only_model()
        if model is None and len(state.backends.model_cards()) > 1:
            raise BadRequest("'model' is required: this router serves several models")
    elif not state.backends.model_is_known(model):
        if not len(state.backends):  # the fleet is empty, not the model unknown
            raise NoHealthyBackend("the router has no backend (add one: POST /admin/backends)")
        raise ModelNotFound(f"the model '{model}' does not exist on any backend")
    state.backends.check_context(model, parsed)
    # the engine gets an id of ours (vLLM may use it as its own request id: two clients
    # must not collide); the client's own id stays in its answer's header and our logs
    rid = new_request_id()
    request[NOTE].request_id = request.headers.get("x-request-id") or rid
    if state.config.log_prompts:  # off by default: prompts are private
        client = client_address(
            request.remote, request.headers.get("X-Forwarded-For"), state.config.trusted_proxies
        )
        log.info(
            "request %s (upstream %s) from %s model %s prompt %r",
            request[NOTE].request_id, rid, client, model, parsed.prompt,
        )  # fmt: skip
    hashes, num_tokens, text_bytes = await _route_keys(
        state, model, parsed.prompt, body, chat, len(raw)
    )
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and type(prompt[0]) is not int:
        text_bytes = None  # a batch: the usage counts every prompt, the keys only the first
    limit = state.backends.max_model_len(model) if model is not None else None
    route_req = RouteRequest(
        request_id=rid,
        model=model,
        block_hashes=hashes,
        num_prompt_tokens=num_tokens,
        max_tokens=parsed.max_tokens,
        session=session_hint(request.headers, body, state.config.sessions),
        # a text prompt's count is an estimate: the engine decides; the cache model skips
        # what is too long, with slack while the estimate rests on the built-in ratio
        cacheable=state.fleet.cacheable(model, num_tokens, limit),
    )
    return route_req, parsed.stream, body, text_bytes


def session_hint(
    headers: Mapping[str, str], body: Mapping[str, Any], config: SessionConfig
) -> str | None:
    """The request's session: the first configured header with a usable value, else the
    body's ``user`` string (if configured); None without one. Unusable (empty, over
    MAX_SESSION_CHARS, a control character) counts as absent: a hint is never refused."""
    for name in config.headers:
        value = headers.get(name)
        if value is not None and _usable(value):
            return value
    user = body.get("user") if config.use_user_field else None
    return user if isinstance(user, str) and _usable(user) else None


def _usable(value: str) -> bool:
    return 0 < len(value) <= MAX_SESSION_CHARS and _CONTROL.search(value) is None


async def _route_keys(
    state: RouterState,
    model: str | None,
    prompt: Prompt,
    body: dict[str, Any],
    chat: bool,
    body_bytes: int,
) -> tuple[list[int], int, int | None]:
    """(block keys, prompt tokens, text bytes): the engine's token ids while the model is
    routed on KV events (exact keys), else text keys and a token estimate from the text's
    UTF-8 bytes (learned per model: Fleet.prompt_tokens_estimate). Long work runs in a
    thread: a real model's tokenizer when OFF_LOOP_MIN_CHARS of text are new to its
    segment cache (Rust that releases the GIL), everything above OFF_LOOP_KEYS_BYTES."""
    fleet = state.fleet
    bs = fleet.block_size_for(model)
    # a salted request shares cache only with its salt, an adapter's only with itself
    lora = model if model is not None and model in state.backends.adapters else None
    seed = chain_seed(salt_of(body), lora)
    off_loop = body_bytes >= OFF_LOOP_KEYS_BYTES
    work: Callable[[], tuple[list[int], int]]
    if fleet.key_kind_for(model) != "tokens":
        hashes, size = await _keys_work(partial(_text_keys, prompt, bs, seed), off_loop)
        if prompt.text is None:
            return hashes, size, None  # token ids: their count is exact
        return hashes, fleet.prompt_tokens_estimate(model, size), size
    tokenizer = state.tokenizer_for(model)
    if tokenizer is BUILTIN_TOKENIZER:
        work = partial(_builtin_keys, prompt, bs, seed)  # the body is parsed already
    elif off_loop:  # a huge body: even rendering and looking up belong in the thread
        work = partial(_tokenizer_keys, tokenizer, body, chat, bs, seed)
    else:
        try:
            pending = tokenizer.start(body, chat)
        except PromptError as exc:
            raise BadRequest(str(exc)) from None
        work = partial(_pending_keys, pending, bs, seed)
        # only the text not tokenized before is worth a thread hop
        off_loop = tokenizer.off_loop and pending.new_chars >= OFF_LOOP_MIN_CHARS
    hashes, num_tokens = await _keys_work(work, off_loop)
    return hashes, num_tokens, None


async def _keys_work(
    work: Callable[[], tuple[list[int], int]], off_loop: bool
) -> tuple[list[int], int]:
    try:
        return await asyncio.to_thread(work) if off_loop else work()
    except PromptError as exc:
        raise BadRequest(str(exc)) from None


def _text_keys(prompt: Prompt, bs: int, seed: int) -> tuple[list[int], int]:
    """(keys, UTF-8 bytes of the text); for token ids, (their keys, their count)."""
    if prompt.text is None:
        return prompt_block_hashes(prompt, bs, seed), prompt.num_tokens_estimate
    return text_route_keys(prompt.text, bs, seed)


def _builtin_keys(prompt: Prompt, bs: int, seed: int) -> tuple[list[int], int]:
    return exact_route_keys(prompt_token_ids(prompt), bs, seed)


def _tokenizer_keys(
    tokenizer: PromptTokenizer, body: dict[str, Any], chat: bool, bs: int, seed: int
) -> tuple[list[int], int]:
    return _pending_keys(tokenizer.start(body, chat), bs, seed)


def _pending_keys(pending: PendingIds, bs: int, seed: int) -> tuple[list[int], int]:
    return exact_route_keys(pending.finish(), bs, seed)
