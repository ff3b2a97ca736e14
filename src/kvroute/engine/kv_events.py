"""KV-cache events in vLLM's wire format (pure: dataclasses and a msgpack codec).

The block manager queues events and the caller drains them (vLLM's BlockPool does the
same); the HTTP simulator publishes them over ZMQ and the router decodes them with
``decode_batch``. A batch on the wire is ``[ts, [event, ...]]`` with an optional
trailing ``data_parallel_rank``. An event is either an array with its tag first
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys]``; vLLM's default msgspec ``array_like`` tagged form) or
a map with a ``"type"`` key and the field names. Older vLLM versions send fewer fields
(the missing ones default), newer ones more (``group_idx``, ...: ignored).

``extra_keys`` holds one entry per block (None, or a list of the block's extra hash
keys: LoRA name, multimodal hashes, and ``cache_salt`` in the request's first block).
``cache_salt_of`` reads the salt back, so the router can key a salted chain as its
requests are keyed.

Block hashes are integers. vLLM can also send 32-byte hashes; the decoder keeps their
last 8 bytes as a big-endian unsigned integer, as llm-d does (it matches vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` lower-64-bit conversion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` of a chain that starts at the root (None: none, or not a root).

    vLLM lists a block's extra keys in order: the LoRA name (when ``lora_name`` is set),
    multimodal ``(identifier, offset)`` pairs, the salt (first block only), then prompt
    embedding digests; so the salt is the first string after the LoRA name.
    """
    if event.parent_block_hash is not None or not event.extra_keys:
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


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

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


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return [_hash_of(v) for v in value] if what == "block_hashes" else [int(v) for v in value]


def _extra_keys(value: Any) -> list[Any] | None:
    if value is None or isinstance(value, list):
        return value
    raise ValueError(f"extra_keys must be a list or nil, got {type(value).__name__}")


def _fields_of(raw: Any) -> tuple[str, dict[str, Any]]:
    """Tag and named fields of one wire event, array or map form."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag not in _FIELDS:
            raise ValueError(f"unknown KV event type {tag!r}")
        return tag, {k: raw[k] for k in _FIELDS[tag] if k in raw}
    if isinstance(raw, list) and raw and raw[0] in _FIELDS:
        tag = raw[0]
        return tag, dict(zip(_FIELDS[tag], raw[1:], strict=False))
    raise ValueError(f"not a KV event: {raw!r:.80}")


def _event_from_wire(raw: Any) -> KvEvent:
    tag, f = _fields_of(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    try:
        hashes = _int_list(f["block_hashes"], "block_hashes")
        if tag == "BlockRemoved":
            return BlockRemoved(hashes, f.get("medium", "GPU"))
        return BlockStored(
            hashes,
            _optional_hash(f.get("parent_block_hash")),
            _int_list(f["token_ids"], "token_ids"),
            int(f["block_size"]),
            f.get("lora_id"),
            f.get("medium", "GPU"),
            f.get("lora_name"),
            _extra_keys(f.get("extra_keys")),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed {tag} event: {exc!r}") from None


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """Timestamp and events of one payload; ValueError when it is not a KV event batch."""
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is [ts, [events...], (dp_rank)]")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"batch timestamp must be a number, got {ts!r}")
    return float(ts), [_event_from_wire(e) for e in batch[1]]


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "cache_salt_of",
    "decode_batch",
    "encode_batch",
]
