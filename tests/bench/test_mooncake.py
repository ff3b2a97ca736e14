"""Mooncake trace replay: sharing reproduced, buckets spread, ceiling arithmetic."""

from __future__ import annotations

import json
import random

import pytest

from kvroute.bench.spec import count_tokens
from kvroute.bench.tracefile import DEFAULT_TRACE, read_mooncake_trace
from kvroute.bench.workloads import make_workload
from kvroute.bench.workloads.mooncake import (
    TraceRow,
    detect_bucket_ms,
    infinite_cache_hit_rate,
    spread_timestamps,
)

# hand-made trace: 512-token blocks; rows 2 and 3 share blocks 0, 1 with row 1
MINI = [
    {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 700, "output_length": 0, "hash_ids": [0, 4]},
    {"timestamp": 3000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
]


@pytest.fixture
def mini_trace(tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MINI))
    return path


def test_ceiling_by_hand(mini_trace):
    rows = read_mooncake_trace(mini_trace)
    # row1: 0 hit; row2: blocks 0,1 -> 1024; row3: block 0 -> 512; row4: 0,1 -> min(1024, 1024)
    want = (0 + 1024 + 512 + 1024) / (1200 + 1100 + 700 + 1024)
    assert infinite_cache_hit_rate(rows) == pytest.approx(want)
    w = make_workload(f"mooncake:{mini_trace}")
    assert w.describe()["cache_ceiling_hit_rate"] == pytest.approx(want)


def test_identical_hash_ids_give_identical_prefixes(mini_trace):
    specs = list(make_workload(f"mooncake:{mini_trace}", seed=3).requests())
    words = [s.prompt.split(" ") for s in specs]
    assert [len(w) for w in words] == [1200, 1100, 700, 1024]
    assert [count_tokens(s.prompt) for s in specs] == [s.num_prompt_tokens for s in specs]
    assert words[0][:1024] == words[1][:1024] == words[3]
    assert words[0][:512] == words[2][:512]
    assert words[0][1024:1100] != words[1][1024:1100]
    assert words[0][512:700] != words[2][512:700]
    assert [s.max_tokens for s in specs] == [10, 20, 1, 5]
    again = list(make_workload(f"mooncake:{mini_trace}", seed=3).requests())
    other = list(make_workload(f"mooncake:{mini_trace}", seed=4).requests())
    assert [s.to_json() for s in again] == [s.to_json() for s in specs]
    assert specs[0].prompt != other[0].prompt


def test_buckets_are_detected_and_spread_in_file_order(mini_trace):
    assert detect_bucket_ms([0, 0, 3000, 3000]) == 3000
    assert detect_bucket_ms([0, 17, 3000, 5123]) == 0.0  # continuous: left alone
    spread = spread_timestamps([0, 0, 0, 3000], 3000, random.Random(1))
    assert spread[:3] == sorted(spread[:3]) and len(set(spread[:3])) == 3
    assert all(0 <= t < 3000 for t in spread[:3]) and 3000 <= spread[3] < 6000
    specs = list(make_workload(f"mooncake:{mini_trace}", overrides={"speedup": "2"}).requests())
    arrivals = [s.arrival_s for s in specs]
    # times count from the trace's first timestamp, halved by the speedup
    assert all(0 <= a < 1.5 for a in arrivals[:2]) and all(1.5 <= a < 3.0 for a in arrivals[2:])


def test_options_cap_scale_and_truncate(mini_trace):
    w = make_workload(
        f"mooncake:{mini_trace}",
        overrides={"max_requests": "2", "input_scale": "0.25", "output_cap": "12"},
    )
    specs = list(w.requests())
    assert len(specs) == 2
    assert [s.num_prompt_tokens for s in specs] == [300, 275]
    assert [s.max_tokens for s in specs] == [10, 12]
    words = [s.prompt.split(" ") for s in specs]
    assert words[0][:256] == words[1][:256]  # two scaled 128-token blocks shared


def test_bad_row_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_mooncake_trace(path)


def test_trace_row_rejects_nonsense():
    with pytest.raises(ValueError):
        TraceRow(0.0, 0, 1, (1,))


@pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="shared Mooncake trace not present")
def test_conversation_trace_ceiling_is_37_4_percent():
    rows = read_mooncake_trace(DEFAULT_TRACE)
    assert len(rows) == 12031
    assert infinite_cache_hit_rate(rows) == pytest.approx(0.374, abs=0.0005)
    assert detect_bucket_ms([r.timestamp_ms for r in rows]) == 3000


def test_tile_interleaves_disjoint_copies(mini_trace):
    one = list(make_workload(f"mooncake:{mini_trace}", seed=3).requests())
    tiled = list(
        make_workload(f"mooncake:{mini_trace}", seed=3, overrides={"tile": "3"}).requests()
    )
    assert len(tiled) == 3 * len(one)
    assert len({s.request_id for s in tiled}) == len(tiled)
    arrivals = [s.arrival_s for s in tiled]
    assert arrivals == sorted(arrivals)
    # each copy has the trace's lengths and sharing, and shares no prompt with another copy
    prompts = [s.prompt for s in tiled]
    assert sorted(s.num_prompt_tokens for s in tiled) == sorted(
        3 * [s.num_prompt_tokens for s in one]
    )
    heads = {p[:2000] for p in prompts}
    assert len(heads) == 3 * len({s.prompt[:2000] for s in one})
    assert sum(1 for p in prompts if p in {s.prompt for s in one}) == len(one)


def test_tiled_copies_keep_token_counts_and_chunk_boundaries(mini_trace):
    from kvroute.bench.workloads.mooncake import tile_marked

    tiled = list(
        make_workload(f"mooncake:{mini_trace}", seed=3, overrides={"tile": "30"}).requests()
    )
    assert all(count_tokens(s.prompt) == s.num_prompt_tokens for s in tiled)
    assert len({s.prompt for s in tiled}) == len(tiled)  # no two copies share a prompt
    text = "data code time list node"
    marked = [tile_marked(text, k) for k in range(1, 700)]
    assert len(set(marked)) == 699 and all(len(m) == len(text) for m in marked)
    assert all(m.split(" ")[2:] == text.split(" ")[2:] for m in marked)


def test_rows_out_of_order_are_replayed_in_timestamp_order(tmp_path):
    # the same rows as MINI, written latest first: each must still arrive at its own time
    # (file order would send every row as soon as the first, the latest, is due)
    rows = [dict(r, timestamp=t) for r, t in zip(MINI, (9000, 6000, 3000, 0), strict=True)]
    path = tmp_path / "reversed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = list(make_workload(f"mooncake:{path}", seed=3).requests())
    assert [s.arrival_s for s in specs] == [0.0, 3.0, 6.0, 9.0]
    assert [s.num_prompt_tokens for s in specs] == [1024, 700, 1100, 1200]
    # rows sharing a timestamp keep their file order
    path.write_text(
        "".join(json.dumps(dict(r, timestamp=3000 - r["timestamp"])) + "\n" for r in MINI)
    )
    w = make_workload(f"mooncake:{path}", seed=3, overrides={"spread_ms": "0"})
    assert [s.num_prompt_tokens for s in w.requests()] == [700, 1024, 1200, 1100]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timestamp", "Infinity"),
        ("timestamp", "-Infinity"),
        ("timestamp", "NaN"),
        ("input_length", "Infinity"),
        ("output_length", "NaN"),
    ],
)
def test_a_non_finite_number_names_the_line(tmp_path, field, value):
    # json reads Infinity and NaN; an infinite arrival would never come (the run hangs)
    row = json.dumps(MINI[3]).replace(f'"{field}": {MINI[3][field]}', f'"{field}": {value}')
    path = tmp_path / "inf.jsonl"
    path.write_text(json.dumps(MINI[0]) + "\n" + row + "\n")
    with pytest.raises(ValueError, match=r"inf\.jsonl:2: not a Mooncake trace row") as exc:
        read_mooncake_trace(path)
    assert field != "timestamp" or "timestamp" in str(exc.value)


def test_a_byte_order_mark_is_read_and_bad_utf8_names_the_line(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in MINI)
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert len(read_mooncake_trace(path)) == 4
    lines = text.encode().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b"0, 1", b"0, \xff1") + lines[2])
    with pytest.raises(ValueError, match=r"bom\.jsonl:2: .*utf-8"):
        read_mooncake_trace(path)


def test_hash_ids_must_be_a_list(tmp_path):
    path = tmp_path / "str.jsonl"
    path.write_text(json.dumps(dict(MINI[0], hash_ids="123")) + "\n")
    with pytest.raises(ValueError, match=r"str\.jsonl:1: .*hash_ids"):
        read_mooncake_trace(path)
