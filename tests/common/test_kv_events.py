"""The KV-event wire codec: vLLM's array form, the map form, byte hashes, extra fields."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    cache_salt_of,
    decode_batch,
    encode_batch,
)

EVENTS = [
    BlockStored([11, 12], None, list(range(32)), 16),
    BlockStored([13], 12, list(range(32, 48)), 16, lora_id=3, medium="CPU"),
    BlockRemoved([11, 2**64 - 1]),
    AllBlocksCleared(),
    BlockStored([21, 22], None, list(range(32)), 16, extra_keys=[["tenant-a"], None]),
]


@pytest.mark.parametrize("form", ["array", "map"])
def test_round_trip(form: str) -> None:
    payload = encode_batch(1234.5, EVENTS, form=form)  # type: ignore[arg-type]
    assert decode_batch(payload) == (1234.5, EVENTS)


def test_array_form_is_vllms_positional_layout() -> None:
    raw = msgspec.msgpack.decode(encode_batch(1.0, EVENTS[:1] + EVENTS[2:4], data_parallel_rank=0))
    assert raw == [
        1.0,
        [
            ["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU", None, None],
            ["BlockRemoved", [11, 2**64 - 1], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def test_map_form_uses_type_key_and_field_names() -> None:
    raw = msgspec.msgpack.decode(encode_batch(2.0, [BlockRemoved([5])], form="map"))
    assert raw == [2.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}]]


def test_decoder_accepts_byte_hashes_extra_fields_and_omitted_defaults() -> None:
    digest = bytes(24) + (0xDEADBEEF).to_bytes(8, "big")  # a 32-byte hash
    payload = msgspec.msgpack.encode(
        [
            7.0,
            [
                ["BlockStored", [digest], None, [1, 2], 2, None, "GPU", "lora-x", None, 0],
                ["BlockStored", [5], digest, [3, 4], 2],  # trailing defaults omitted
                {"type": "BlockRemoved", "block_hashes": [digest], "group_idx": 0},
                {"type": "AllBlocksCleared", "extra": 1},
            ],
            3,
        ]
    )
    ts, events = decode_batch(payload)
    assert ts == 7.0
    assert events == [
        BlockStored([0xDEADBEEF], None, [1, 2], 2, lora_name="lora-x"),
        BlockStored([5], 0xDEADBEEF, [3, 4], 2),
        BlockRemoved([0xDEADBEEF]),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["now", []]),
        msgspec.msgpack.encode([1.0, [["BlockEvicted", [1]]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5]]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None, 7]]]),
    ],
)
def test_malformed_batches_raise_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_unknown_form_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_batch(0.0, [], form="json")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parent", "lora_name", "extra_keys", "salt"),
    [
        (None, None, [["tenant-a"], None], "tenant-a"),
        (None, "ad", [["ad", "tenant-a"], ["ad"]], "tenant-a"),  # LoRA name first
        (None, "ad", [["ad"], ["ad"]], None),  # only the adapter
        (None, None, [[["mm-1", 0], "tenant-a", b"emb"]], "tenant-a"),  # image, salt, embeds
        (None, None, None, None),
        (None, None, [None, None], None),
        (7, None, [["tenant-a"]], None),  # not at the root: the salt is not in this event
    ],
)
def test_cache_salt_of_reads_the_first_blocks_last_extra_key(parent, lora_name, extra_keys, salt):
    event = BlockStored([1, 2], parent, list(range(4)), 2, lora_name=lora_name,
                        extra_keys=extra_keys)  # fmt: skip
    assert cache_salt_of(event) == salt
