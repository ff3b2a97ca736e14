"""A real model's tokenization for exact-mode keys: tokenizer.json + Jinja chat template.

Optional: needs the ``tokenizers`` and ``jinja2`` packages (``load_tokenizer`` raises
ImportError naming them otherwise). It mirrors what vLLM does with a
``PreTrainedTokenizerFast``: a completion prompt is encoded with special tokens (the
tokenizer's post-processor may add BOS); a chat is rendered with the model's
``chat_template`` (``add_generation_prompt=True``) and encoded without special tokens,
since the template writes them. Token-id prompts pass through unchanged.

Encoding goes through ``encode_batch``, which releases the GIL (``encode`` holds it), so
the proxy can tokenize a long prompt in a thread while its event loop keeps serving:
about 6 ms for 4,400 tokens with a small BPE here, long enough to stall every other
request of the worker.

Most of that work repeats: a system prompt, tool definitions, a document or the earlier
turns of a conversation come back with every request, byte for byte. A tokenizer never
merges across an added token (it splits the text at them before anything else), so
the text between two of them (a *segment*: in a chat, usually one message) always
encodes to the same ids. ``SegmentCache`` keeps those ids, keyed by the segment with
the added tokens on either side (which may strip whitespace next to them, or tell a
pre-tokenizer it is not at the start), bounded in bytes; a request encodes only the
segments it has not seen, in one batch.
"""

from __future__ import annotations

import json
import pathlib
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.core.keys import PromptError, prompt_of
from kvroute.core.token_keys import ReadyIds


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Where a served model's tokenizer lives."""

    model: str  # served model name the keys are for
    path: str  # directory with tokenizer.json and (for chat) tokenizer_config.json


class HfPromptTokenizer:
    """``PromptTokenizer`` over a HuggingFace ``tokenizers`` file and a chat template."""

    off_loop = True

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        special: dict[str, str],
        cache_bytes: int = 64 << 20,
    ):
        self._tokenizer = tokenizer
        self._segments = SegmentCache(tokenizer, cache_bytes)
        self._template: Any = None
        self._special = special  # bos_token, eos_token, ... for the template
        if chat_template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
            self._template = env.from_string(chat_template)

    def start(self, body: dict[str, Any], chat: bool) -> PendingIds | ReadyIds:
        if chat:
            return self._segments.start(self._render(body), add_special_tokens=False)
        prompt = prompt_of(body, chat=False)
        if prompt.token_ids is not None:
            return ReadyIds(prompt.token_ids)
        assert prompt.text is not None, "Prompt holds text or token ids"
        return self._segments.start(prompt.text, add_special_tokens=True)

    def token_ids(self, body: dict[str, Any], chat: bool) -> Sequence[int]:
        return self.start(body, chat).finish()

    def _render(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        if self._template is None:
            raise PromptError("this model has no chat template")
        text: str = self._template.render(
            messages=messages, tools=body.get("tools"), add_generation_prompt=True, **self._special
        )
        return text


Segment = tuple[str, str, str]  # (added token before or "", text, added token after or "")


class SegmentCache:
    """``encode(text)``, equal to the tokenizer's, remembering the ids of each segment.

    In two steps, so a caller can put only the second in a thread: ``start`` splits the
    text and looks its segments up (``PendingIds.new_chars``: the text left to encode),
    ``finish`` encodes the rest in one batch and joins the ids. Bounded: at most
    ``max_bytes`` of cached segment text plus their ids (8 bytes an id), least recently
    used first out; a segment bigger than a quarter of that is encoded but not kept.
    Thread-safe (the proxy tokenizes in threads).
    """

    def __init__(self, tokenizer: Any, max_bytes: int):
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder().values()
        # the tokens the tokenizer matches on the raw text, anywhere (not after
        # normalising, not only as whole words); longest first, as it matches them
        raw = [t.content for t in added if t.content and not t.normalized and not t.single_word]
        raw.sort(key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, raw)) + ")") if raw else None
        self._ids = {t: tokenizer.token_to_id(t) for t in raw}
        self._affixes = _post_processor_affixes(tokenizer)
        self._cache: OrderedDict[Segment, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.hits = self.misses = 0

    def encode(self, text: str, add_special_tokens: bool) -> Sequence[int]:
        return self.start(text, add_special_tokens).finish()

    def start(self, text: str, add_special_tokens: bool) -> PendingIds:
        if add_special_tokens and self._affixes is None:  # a post-processor we cannot mimic
            return PendingIds(self, [text], [], [], add_special_tokens, len(text), whole=True)
        parts = self._split.split(text) if self._split is not None else [text]
        # parts alternate: text, added token, text, ..., text; a segment is a non-empty text
        segments = [
            (parts[k - 1] if k else "", parts[k], parts[k + 1] if k + 1 < len(parts) else "")
            for k in range(0, len(parts), 2)
            if parts[k]
        ]
        with self._lock:
            found = [self._cache.get(seg) for seg in segments]
            for seg, ids in zip(segments, found, strict=True):
                if ids is not None:
                    self._cache.move_to_end(seg)
                    self.hits += 1
        new_chars = sum(
            len(seg[1]) for seg, ids in zip(segments, found, strict=True) if ids is None
        )
        return PendingIds(self, parts, segments, found, add_special_tokens, new_chars)

    def finish(self, pending: PendingIds) -> array[int]:
        """The ids of ``pending``'s text: its unknown segments encoded, all joined."""
        if pending.whole:
            return array("Q", self._tokenizer.encode(pending.parts[0], add_special_tokens=True).ids)
        known = list(zip(pending.segments, pending.found, strict=True))
        missing = [seg for seg, ids in known if ids is None]
        fresh = self._encode(missing) if missing else {}
        segment_ids = (fresh[seg] if ids is None else ids for seg, ids in known)
        head, tail = self._affixes if pending.add_special_tokens else ((), ())  # type: ignore[misc]
        out = array("Q", head)
        for k, part in enumerate(pending.parts):
            if k % 2:
                out.append(self._ids[part])
            elif part:
                out.extend(next(segment_ids))
        out.extend(tail)
        return out

    def _encode(self, missing: list[Segment]) -> dict[Segment, array[int]]:
        # with its neighbours, so the tokenizer sees the segment as it sits in the text
        texts = [b + t + a for b, t, a in missing]
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        fresh = {}
        for (b, t, a), enc in zip(missing, encoded, strict=True):
            ids = enc.ids  # the neighbours are one added token each: drop their ids
            fresh[(b, t, a)] = array("Q", ids[1 if b else 0 : len(ids) - 1 if a else len(ids)])
        with self._lock:
            self.misses += len(missing)
            for seg, seg_ids in fresh.items():
                self._keep(seg, seg_ids)
        return fresh

    def _keep(self, seg: Segment, ids: array[int]) -> None:
        size = sum(map(len, seg)) + 8 * len(ids)
        if seg in self._cache or size > self.max_bytes // 4:
            return
        self._cache[seg] = ids
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            old, old_ids = self._cache.popitem(last=False)
            self.num_bytes -= sum(map(len, old)) + 8 * len(old_ids)


@dataclass(slots=True)
class PendingIds:
    """A text split and looked up (``SegmentCache.start``); ``finish`` gives its ids."""

    cache: SegmentCache
    parts: list[str]  # text, added token, text, ..., text
    segments: list[Segment]  # the non-empty texts of ``parts``, with their neighbours
    found: list[array[int] | None]  # each segment's cached ids, None: still to encode
    add_special_tokens: bool
    new_chars: int  # characters still to encode
    whole: bool = False  # encode ``parts[0]`` whole (a post-processor we cannot mimic)

    def finish(self) -> Sequence[int]:
        return self.cache.finish(self)


def _post_processor_affixes(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a single text (BOS, EOS), or
    None when it does more than wrap the text (then completions encode whole)."""
    affixes = set()
    for probe in ("x", "hello world", "a\nb"):
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        starts = range(len(full) - len(bare) + 1)
        at = next((k for k in starts if full[k : k + len(bare)] == bare), None)
        if at is None:
            return None
        affixes.add((tuple(full[:at]), tuple(full[at + len(bare) :])))
    if len(affixes) != 1:
        return None
    head, tail = affixes.pop()
    return list(head), list(tail)


def load_tokenizer(path: str | pathlib.Path) -> HfPromptTokenizer:
    """Load ``path``/tokenizer.json and the chat template of ``path``/tokenizer_config.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError("exact mode on real models needs: pip install tokenizers jinja2") from exc
    root = pathlib.Path(path)
    if not (root / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in {root}")
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    config: dict[str, Any] = {}
    if (root / "tokenizer_config.json").is_file():
        config = json.loads((root / "tokenizer_config.json").read_text())
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token")}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return HfPromptTokenizer(tokenizer, template, special)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken form {"content": "<s>", ...}
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise(message: str) -> None:
    raise PromptError(f"chat template: {message}")
