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


def test_decoder_accepts_byte_hashes_groups_and_omitted_defaults() -> None:
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
        BlockStored([0xDEADBEEF], None, [1, 2], 2, lora_name="lora-x", group_idx=0),
        BlockStored([5], 0xDEADBEEF, [3, 4], 2),
        BlockRemoved([0xDEADBEEF], group_idx=0),
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


def test_vllm_0_34_events_keep_their_group_and_its_kind() -> None:
    """vLLM 0.34 (vllm/distributed/kv_events.py) sends 15 fields after the tag; of those
    past extra_keys, group_idx and kv_cache_spec_kind are read (hybrid models)."""
    stored = ["BlockStored", [1], None, [5, 6], 2, None, "GPU", None, None,
              1, "sliding_window", 4096, None, None, "sess", None]  # fmt: skip
    removed = ["BlockRemoved", [1], "GPU", 1, None, None]
    _, events = decode_batch(msgspec.msgpack.encode([1.0, [stored, removed]]))
    assert events == [
        BlockStored([1], None, [5, 6], 2, group_idx=1, kv_cache_spec_kind="sliding_window"),
        BlockRemoved([1], group_idx=1),
    ]


@pytest.mark.parametrize("session", [None, "sess-1"])
def test_sglang_stores_read_its_salt_session_and_adapter_fields(session: str | None) -> None:
    """SGLang 0.5 (srt/disaggregation/kv_events.py): after medium come cache_salt,
    session_id and lora_name. Read as vLLM's layout, the salt became an adapter name and
    a session id failed the whole batch (extra_keys must be a list)."""
    stored = ["BlockStored", [9], None, [1, 2], 2, None, "GPU", "salt-a", session, "ad-1"]
    _, events = decode_batch(msgspec.msgpack.encode([1.0, [stored]]))
    (event,) = events
    assert isinstance(event, BlockStored)
    assert (event.cache_salt, event.lora_name, event.extra_keys) == ("salt-a", "ad-1", None)
    assert cache_salt_of(event) == "salt-a"
    mapped = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "cache_salt": "salt-a"}  # fmt: skip
    _, (event,) = decode_batch(msgspec.msgpack.encode([1.0, [mapped]]))
    assert cache_salt_of(event) == "salt-a"  # type: ignore[arg-type]


def test_sglang_eagle_bigrams_are_read_as_their_tokens() -> None:
    """SGLang under EAGLE sends each page's tokens as (token, next token) pairs
    (srt/mem_cache/events.py); the batch was refused as malformed."""
    stored = ["BlockStored", [9], None, [[1, 2], [2, 3], [3, 4]], 3, None, "GPU"]
    _, (event,) = decode_batch(msgspec.msgpack.encode([1.0, [stored]]))
    assert event.token_ids == [1, 2, 3]  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode([1.0, [[*stored[:3], [[1, 2, 3]], 1]]]))
