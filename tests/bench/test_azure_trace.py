"""Azure LLM inference trace replay: arrivals and lengths kept, no prompt shared."""

from __future__ import annotations

import itertools
import math

import pytest

from kvroute.bench.load import default_load
from kvroute.bench.procs import parse_router
from kvroute.bench.tracefile import DEFAULT_AZURE_TRACE, read_azure_trace, read_mooncake_trace
from kvroute.bench.workloads import is_trace_replay, make_workload
from kvroute.des.simulation import simulate_router
from kvroute.engine import PROFILES

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
# Azure's own shape: 100-ns fractions, one row on a whole second (no fraction)
MINI = (
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,1025,109\n"
    "2023-11-16 18:15:51,512,7\n"
    "2023-11-16 18:15:51.5000000,40,1\n"
)


@pytest.fixture
def mini_trace(tmp_path):
    path = tmp_path / "mini.csv"
    path.write_text(HEADER + MINI)
    return path


def test_rows_keep_arrivals_and_lengths_and_share_no_block(mini_trace) -> None:
    rows = read_azure_trace(mini_trace)
    assert [r.input_length for r in rows] == [374, 1025, 512, 40]
    assert [r.output_length for r in rows] == [44, 109, 7, 1]
    assert [r.timestamp_ms for r in rows] == pytest.approx([0.0, 4314.579, 4319.41, 4819.41])
    assert [len(r.hash_ids) for r in rows] == [math.ceil(r.input_length / 512) for r in rows]
    ids = [h for r in rows for h in r.hash_ids]
    assert len(ids) == len(set(ids))
    assert len(read_azure_trace(mini_trace, max_rows=2)) == 2


def test_the_2024_traces_utc_offsets_read_beside_plain_stamps(tmp_path) -> None:
    # Azure's 2024 traces write a UTC offset, a 6-digit fraction and whole seconds bare
    path = tmp_path / "azure2024.csv"
    path.write_text(
        HEADER
        + "2024-05-10 00:00:00.009930+00:00,10,2\n"
        + "2024-05-10 00:00:01+00:00,20,3\n"
        + "2024-05-10 00:00:02.5000000,30,4\n"
    )
    rows = read_azure_trace(path)
    assert [r.timestamp_ms for r in rows] == pytest.approx([0.0, 990.07, 2490.07])


def test_a_file_that_is_not_an_azure_trace_is_named(tmp_path) -> None:
    other = tmp_path / "other.csv"
    other.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="no column TIMESTAMP, ContextTokens"):
        read_azure_trace(other)
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + MINI + "2023-11-16 18:15:52.1,many,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv:6: not an Azure trace row"):
        read_azure_trace(bad)


def test_the_workload_replays_every_prompt_new(mini_trace) -> None:
    assert is_trace_replay("azure") and is_trace_replay(f"azure:{mini_trace}")
    assert is_trace_replay("mooncake") and not is_trace_replay("gsp")
    w = make_workload(f"azure:{mini_trace}", seed=1)
    assert w.name == "azure" and w.describe()["cache_ceiling_hit_rate"] == 0.0
    specs = list(w.requests())
    assert [s.num_prompt_tokens for s in specs] == [374, 1025, 512, 40]
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 4.314579, 4.31941, 4.81941])
    assert all(s.request_id.startswith("azure-") for s in specs)
    firsts = {tuple(s.prompt.split(" ")[:8]) for s in specs}
    assert len(firsts) == 4  # no two prompts begin alike
    scaled = make_workload(f"azure:{mini_trace}", seed=1, overrides={"speedup": "2"})
    assert [s.arrival_s for s in scaled.requests()][1] == pytest.approx(4.314579 / 2)


def test_a_simulated_replay_completes_every_row_with_no_hit(mini_trace) -> None:
    w = make_workload(f"azure:{mini_trace}")
    for router in ("round_robin", "kvroute"):
        bench, _ = simulate_router(
            parse_router(router), PROFILES["llama-3.1-8b-a100"], 2, w, default_load(w)
        )
        assert bench.result["completed"] == 4 and bench.result["failed"] == 0
        assert sum(row["prefix_cache_hits"] for row in bench.result["per_backend"]) == 0


@pytest.mark.skipif(not DEFAULT_AZURE_TRACE.exists(), reason="shared Azure trace not present")
def test_the_shared_conversation_trace_reads_whole() -> None:
    rows = read_azure_trace(DEFAULT_AZURE_TRACE)
    assert len(rows) == 19_366
    assert all(b.timestamp_ms >= a.timestamp_ms for a, b in itertools.pairwise(rows))
    assert 3_000_000 < rows[-1].timestamp_ms < 3_700_000  # about an hour


@pytest.mark.parametrize("reader", [read_azure_trace, read_mooncake_trace])
def test_a_missing_trace_file_says_how_to_name_one(tmp_path, reader) -> None:
    with pytest.raises(ValueError, match="--trace PATH"):
        reader(tmp_path / "nowhere.csv")


@pytest.mark.parametrize(
    ("reader", "text"), [(read_azure_trace, HEADER), (read_mooncake_trace, "\n")]
)
def test_a_trace_without_rows_is_an_error(tmp_path, reader, text) -> None:
    path = tmp_path / "empty"
    path.write_text(text)
    with pytest.raises(ValueError, match="no rows"):
        reader(path)


def test_rows_out_of_order_are_replayed_in_timestamp_order(tmp_path) -> None:
    path = tmp_path / "reversed.csv"
    path.write_text(HEADER + "".join(reversed(MINI.splitlines(keepends=True))))
    assert [r.timestamp_ms for r in read_azure_trace(path)] == pytest.approx(
        [4819.41, 4319.41, 4314.579, 0.0]
    )
    specs = list(make_workload(f"azure:{path}").requests())
    assert [s.num_prompt_tokens for s in specs] == [374, 1025, 512, 40]
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 4.314579, 4.31941, 4.81941])


@pytest.mark.parametrize(
    "row", ["inf,374,44", "nan,374,44", "2023-11-16 18:15:52,inf,3", "2023-11-16 18:15:52,3,nan"]
)
def test_a_non_finite_value_names_the_line(tmp_path, row) -> None:
    path = tmp_path / "inf.csv"
    path.write_text(HEADER + MINI + row + "\n")
    with pytest.raises(ValueError, match=r"inf\.csv:6: not an Azure trace row"):
        read_azure_trace(path)


def test_a_byte_order_mark_is_read_and_bad_utf8_names_the_line(tmp_path) -> None:
    # as Excel writes a CSV: the header's first column is still TIMESTAMP
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + MINI).encode())
    assert [r.input_length for r in read_azure_trace(path)] == [374, 1025, 512, 40]
    path.write_bytes((HEADER + MINI).encode() + b"2023-11-16 18:15:52,\xff,3\n")
    with pytest.raises(ValueError, match=r"bom\.csv:6: .*utf-8"):
        read_azure_trace(path)
