"""KV-cache events in vLLM's wire format (pure: dataclasses and a msgpack codec).

The block manager queues events and the caller drains them (vLLM's BlockPool does the
same); the HTTP simulator publishes them over ZMQ and the router decodes them with
``decode_batch``. A batch on the wire is ``[ts, [event, ...]]`` with an optional
trailing ``data_parallel_rank``. An event is either an array with its tag first
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys]``; vLLM's default msgspec ``array_like`` tagged form) or
a map with a ``"type"`` key and the field names. Older vLLM versions send fewer fields
(the missing ones default), newer ones more: of those, the KV cache group (``group_idx``,
and on a store the group's ``kv_cache_spec_kind``) is read, so a hybrid model's groups
can be told apart; the rest is ignored.

SGLang sends the same events with its own fields after ``medium``: ``cache_salt``,
``session_id``, ``lora_name``. In array form that is ten elements whose last is a name
or nil, where a vLLM event of ten elements ends with its group (an integer): the
layout is read from that. SGLang under EAGLE sends each token as a ``[token, next]``
bigram; the first of each pair is the token.

``extra_keys`` holds one entry per block (None, or a list of the block's extra hash
keys: LoRA name, multimodal hashes, and ``cache_salt`` in the request's first block).
``cache_salt_of`` reads the salt back, so the router can key a salted chain as its
requests are keyed.

Block hashes are integers. vLLM can also send 32-byte hashes; the decoder keeps their
last 8 bytes as a big-endian unsigned integer, as llm-d does (it matches vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` lower-64-bit conversion).

The decoder takes bytes from the network: anything that is not a well-formed batch
within ``KvEventLimits`` raises ValueError, never another exception. ``BatchReader``
decodes a batch a few events at a time and ``split_events`` cuts decoded events into
parts of bounded work, so a caller with an event loop can yield between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that became cached, one chain segment (parent first)."""

    block_hashes: list[int]  # hashes of the new blocks, in token order
    parent_block_hash: int | None  # hash of the block before the first one; None at the root
    token_ids: list[int]  # all tokens of these blocks (len = block_size * len(block_hashes))
    block_size: int  # tokens per block
    lora_id: int | None = None  # LoRA adapter id, None for the base model
    medium: str | None = "GPU"  # cache tier ("GPU" or "CPU")
    lora_name: str | None = None  # LoRA adapter name (newer vLLM)
    extra_keys: list[Any] | None = None  # per block: None or its extra keys (newer vLLM)
    cache_salt: str | None = None  # the storing request's salt, as SGLang sends it
    group_idx: int | None = None  # KV cache group (vLLM hybrid models); None: the only one
    kv_cache_spec_kind: str | None = None  # that group's kind ("full_attention", ...)


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` of a chain that starts at the root (None: none, or not a root).

    vLLM lists a block's extra keys in order: the LoRA name (when ``lora_name`` is set),
    multimodal ``(identifier, offset)`` pairs, the salt (first block only), then prompt
    embedding digests; so the salt is the first string after the LoRA name.
    """
    if event.parent_block_hash is not None:
        return None
    if event.cache_salt is not None:
        return event.cache_salt
    if not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, list):
        return None
    strings = [x for x in first if isinstance(x, str)]
    if event.lora_name is not None and strings[:1] == [event.lora_name]:
        strings = strings[1:]
    return strings[0] if strings else None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted (their hashes dropped from the cache)."""

    block_hashes: list[int]  # hashes that are no longer cached on this medium
    medium: str | None = "GPU"  # cache tier
    group_idx: int | None = None  # KV cache group (vLLM hybrid models)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventLimits:
    """Bounds on one batch; a batch past any of them is rejected whole (ValueError).

    A vLLM step stores at most its batched tokens and evicts about as many blocks, so
    real batches stay far below these (a few thousand blocks, under 1 MB).
    """

    max_events: int = 1 << 16  # events per batch
    max_blocks: int = 1 << 18  # block hashes per batch, all events together
    max_blocks_per_event: int = 1 << 15  # block hashes per event
    max_tokens_per_event: int = 1 << 20  # token ids per BlockStored
    max_block_size: int = 1 << 16  # tokens per block

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"KvEventLimits.{name} must be >= 1")


DEFAULT_LIMITS = KvEventLimits()

_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
# fields read beyond _FIELDS: vLLM's after extra_keys (then more, ignored) and after
# medium on a removal; SGLang's after medium on a store
_VLLM_MORE = {"BlockStored": ("group_idx", "kv_cache_spec_kind"), "BlockRemoved": ("group_idx",)}
_SGLANG_STORED = (*_FIELDS["BlockStored"][:6], "cache_salt", "session_id", "lora_name")
_MAP_MORE = ("group_idx", "kv_cache_spec_kind", "cache_salt")
_TYPES: dict[str, Any] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def _event_to_wire(event: KvEvent, form: str) -> list[Any] | dict[str, Any]:
    tag = type(event).__name__
    values = [getattr(event, name) for name in _FIELDS[tag]]
    if form == "array":
        return [tag, *values]
    return {"type": tag, **dict(zip(_FIELDS[tag], values, strict=True))}


def encode_batch(
    ts: float,
    events: Sequence[KvEvent],
    *,
    form: Literal["array", "map"] = "array",
    data_parallel_rank: int | None = None,
) -> bytes:
    """One msgpack KVEventBatch payload: ``[ts, events]`` (+ rank when given)."""
    if form not in ("array", "map"):
        raise ValueError(f"form must be 'array' or 'map', got {form!r}")
    batch: list[Any] = [float(ts), [_event_to_wire(e, form) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return _ENCODER.encode(batch)


def _hash_of(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"block hash must be an int or bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value)[-8:], "big")
    raise ValueError(f"block hash must be an int or bytes, got {type(value).__name__}")


def _optional_hash(value: Any) -> int | None:
    return None if value is None else _hash_of(value)


def _hashes(value: Any, limits: KvEventLimits) -> list[int]:
    if not isinstance(value, list):
        raise ValueError("block_hashes must be a list")
    if len(value) > limits.max_blocks_per_event:
        raise ValueError(
            f"{len(value)} block hashes in one event (limit {limits.max_blocks_per_event})"
        )
    return [_hash_of(v) for v in value]


def _token_ids(value: Any, limits: KvEventLimits) -> list[int]:
    if not isinstance(value, list):
        raise ValueError("token_ids must be a list")
    if len(value) > limits.max_tokens_per_event:
        raise ValueError(
            f"{len(value)} token ids in one event (limit {limits.max_tokens_per_event})"
        )
    # bool is an int subclass; msgpack ints are within 64 bits already
    if all(type(v) is int for v in value):
        return value
    if all(type(v) is list and len(v) == 2 and type(v[0]) is type(v[1]) is int for v in value):
        return [v[0] for v in value]  # SGLang's EAGLE bigrams: (token, next token)
    raise ValueError("token_ids must be integers")


def _block_size(value: Any, limits: KvEventLimits) -> int:
    if type(value) is not int or not 1 <= value <= limits.max_block_size:
        raise ValueError(
            f"block_size must be an integer in [1, {limits.max_block_size}], got {value!r:.40}"
        )
    return value


def _optional(value: Any, kind: type, what: str) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{what} must be a {kind.__name__} or nil, got {type(value).__name__}")


def _fields_of(raw: Any) -> tuple[str, dict[str, Any]]:
    """Tag and named fields of one wire event, array or map form."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _FIELDS:
            raise ValueError(f"unknown KV event type {tag!r:.80}")
        return tag, {k: raw[k] for k in (*_FIELDS[tag], *_MAP_MORE) if k in raw}
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _FIELDS:
        tag = raw[0]
        if tag == "BlockStored" and len(raw) == 10 and not isinstance(raw[9], int):
            return tag, dict(zip(_SGLANG_STORED, raw[1:], strict=True))
        names = (*_FIELDS[tag], *_VLLM_MORE.get(tag, ()))
        return tag, dict(zip(names, raw[1:], strict=False))
    raise ValueError(f"not a KV event: {raw!r:.80}")


def _event_from_wire(raw: Any, limits: KvEventLimits = DEFAULT_LIMITS) -> KvEvent:
    tag, f = _fields_of(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if "block_hashes" not in f:
        raise ValueError(f"malformed {tag} event: no block_hashes")
    hashes = _hashes(f["block_hashes"], limits)
    medium = _optional(f.get("medium", "GPU"), str, "medium")
    group = _optional(f.get("group_idx"), int, "group_idx")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium, group)
    if "token_ids" not in f or "block_size" not in f:
        raise ValueError("malformed BlockStored event: no token_ids or block_size")
    token_ids = _token_ids(f["token_ids"], limits)
    return BlockStored(
        hashes,
        _optional_hash(f.get("parent_block_hash")),
        token_ids,
        _block_size(f["block_size"], limits),
        _optional(f.get("lora_id"), int, "lora_id"),
        medium,
        _optional(f.get("lora_name"), str, "lora_name"),
        _optional(f.get("extra_keys"), list, "extra_keys"),
        _optional(f.get("cache_salt"), str, "cache_salt"),
        group,
        _optional(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
    )


_RAW_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _num_blocks(event: KvEvent) -> int:
    return 0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)


# work is counted in blocks of this many tokens (vLLM's default block size), so that a
# slice of big blocks (up to 65,536 tokens each) is as cheap as one of usual blocks
UNIT_TOKENS = 16


def event_work(event: KvEvent) -> int:
    """What decoding and applying ``event`` costs, in blocks of ``UNIT_TOKENS`` tokens
    (at least 1: an event without blocks costs something too)."""
    if isinstance(event, AllBlocksCleared):
        return 1
    n = len(event.block_hashes)
    if isinstance(event, BlockStored):
        n = max(n, len(event.token_ids) // UNIT_TOKENS)
    return max(1, n)


class BatchReader:
    """One payload's events, decoded on demand (``read``) within ``limits``.

    The constructor reads only the batch's frame (timestamp, event count): each event
    stays encoded until read, so decoding can be spread over several calls.
    """

    def __init__(self, payload: bytes, limits: KvEventLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        try:
            outer = _RAW_LIST.decode(payload)
            if len(outer) < 2:
                raise ValueError("a KV event batch is [ts, [events...], (dp_rank)]")
            ts = _DECODER.decode(outer[0])
            self._raw = _RAW_LIST.decode(outer[1])
        except msgspec.DecodeError as exc:  # ValidationError included: not [ts, [..]]
            raise ValueError(f"not a KV event batch: {exc}") from None
        except RecursionError:  # msgspec's own depth limit, even when skipping a Raw
            raise ValueError("not a KV event batch: nested too deeply") from None
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise ValueError(f"batch timestamp must be a finite number, got {ts!r:.40}")
        if len(self._raw) > limits.max_events:
            raise ValueError(f"{len(self._raw)} events in one batch (limit {limits.max_events})")
        self.ts = float(ts)
        self._next = 0  # index of the next event to decode
        self._num_blocks = 0  # block hashes decoded so far

    @property
    def remaining(self) -> int:
        return len(self._raw) - self._next

    def read(self, max_blocks: int | None = None) -> list[KvEvent]:
        """Decode the next events, until their work (``event_work``) reaches ``max_blocks``
        or the batch ends; ValueError when one is malformed or the batch exceeds its
        limits."""
        events = []
        work = 0
        while self._next < len(self._raw) and (max_blocks is None or work < max_blocks):
            raw = self._raw[self._next]
            self._next += 1
            try:
                event = _event_from_wire(_DECODER.decode(raw), self.limits)
            except msgspec.DecodeError as exc:
                raise ValueError(f"not msgpack: {exc}") from None
            except (TypeError, OverflowError, RecursionError) as exc:  # a value of the wrong shape
                raise ValueError(f"malformed KV event: {exc!r:.120}") from None
            n = _num_blocks(event)
            self._num_blocks += n
            if self._num_blocks > self.limits.max_blocks:
                raise ValueError(f"more than {self.limits.max_blocks} blocks in one batch")
            events.append(event)
            work += event_work(event)
        return events


def decode_batch(
    payload: bytes, limits: KvEventLimits = DEFAULT_LIMITS
) -> tuple[float, list[KvEvent]]:
    """Timestamp and events of one payload; ValueError when it is not a KV event batch."""
    reader = BatchReader(payload, limits)
    return reader.ts, reader.read()


def split_events(events: Sequence[KvEvent], max_blocks: int) -> Iterator[list[KvEvent]]:
    """``events`` in consecutive parts of at most ``max_blocks`` work each (``event_work``:
    blocks, or ``UNIT_TOKENS`` tokens where blocks are bigger; at least one event per
    part). A longer ``BlockStored`` or ``BlockRemoved`` is cut into pieces: a stored piece
    names the block before it as its parent, so applying the parts in order is applying
    the events."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    part: list[KvEvent] = []
    size = 0
    for event in events:
        for piece in _pieces(event, max_blocks):
            n = event_work(piece)
            if part and size + n > max_blocks:
                yield part
                part, size = [], 0
            part.append(piece)
            size += n
    if part:
        yield part


def _pieces(event: KvEvent, max_work: int) -> Iterator[KvEvent]:
    if isinstance(event, AllBlocksCleared) or event_work(event) <= max_work:
        yield event
        return
    hashes = event.block_hashes
    step = max_work
    if isinstance(event, BlockStored):  # blocks bigger than a unit: fewer per piece
        step = max(1, max_work // max(1, event.block_size // UNIT_TOKENS))
    for start in range(0, len(hashes), step):
        end = start + step
        if isinstance(event, BlockRemoved):
            yield BlockRemoved(hashes[start:end], event.medium, event.group_idx)
            continue
        bs = event.block_size
        extra = event.extra_keys
        yield replace(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=hashes[start - 1] if start else event.parent_block_hash,
            token_ids=event.token_ids[start * bs : end * bs],
            extra_keys=extra[start:end] if extra is not None else None,
        )


__all__ = [
    "DEFAULT_LIMITS",
    "AllBlocksCleared",
    "BatchReader",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventLimits",
    "cache_salt_of",
    "decode_batch",
    "encode_batch",
    "event_work",
    "split_events",
]
