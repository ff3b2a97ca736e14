"""End to end: ``kvroute bench`` against the fake streaming server writes every output."""

from __future__ import annotations

import json

import pytest

from kvroute.cli import main

DESIGN_KEYS = {
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "engine_prefix_hit_rate",
    "router_stickiness",
    "backend_load_imbalance",
    "per_backend",
    "workload",
    "router",
    "config",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p50", "p90", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}


def test_kvroute_bench_writes_result_records_and_plots(fake_in_thread, tmp_path, capsys):
    url, _state = fake_in_thread
    out = tmp_path / "run"
    rc = main(
        [
            "bench",
            "--target", url,
            "--workload", "ranvier-stress",
            "--workload-arg", "large_prefix_tokens=60,70,90",
            "--workload-arg", "xlarge_min_tokens=80",
            "--workload-arg", "max_tokens=3",
            "--concurrency", "4",
            "--think-time", "0,0.01",
            "--num-requests", "16",
            "--num-warmup", "2",
            "--backend-metrics", f"{url}/b0", f"{url}/b1",
            "--router", "fake-router",
            "--out", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Engine prefix hit rate" in printed
    result = json.loads((out / "result.json").read_text())
    assert set(result) >= DESIGN_KEYS
    assert result["completed"] == 16 and result["router"] == "fake-router"
    assert result["workload"]["name"] == "ranvier-stress"
    assert result["config"]["load"]["num_users"] == 4
    assert 0.0 <= result["engine_prefix_hit_rate"] <= 1.0
    assert len(result["per_backend"]) == 2
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 18 and sum(r["warmup"] for r in records) == 2
    for name in ("ttft.png", "backends.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_bad_flags_exit_2_with_a_message(capsys):
    rc = main(["bench", "--target", "http://127.0.0.1:9", "--workload", "nope", "--quiet"])
    assert rc == 2 and "unknown workload" in capsys.readouterr().err
    rc = main(["bench", "--target", "http://x", "--workload", "gsp", "--speedup", "2"])
    assert rc == 2 and "mooncake" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    "flag",
    ["--duration", "--timeout", "--think-time", "--speedup", "--input-scale", "--burstiness"],
)
def test_bench_refuses_a_non_finite_number(capsys, flag, value) -> None:
    # an infinite duration or think time never ends; nan compares false with everything
    args = ["bench", "--target", "http://127.0.0.1:9", "--workload", "mooncake", "--quiet"]
    with pytest.raises(SystemExit) as exc:
        main([*args, f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--duration", "inf"),
        ("--duration", "nan"),
        ("--think-time", "1,inf"),
        ("--speedup", "inf"),
        ("--startup-timeout", "nan"),
    ],
)
def test_compare_refuses_a_non_finite_number(capsys, flag, value) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--workload", "gsp", f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "compare", "simulate"])
@pytest.mark.parametrize("workload", ["gsp", "mooncake:{trace}"])
def test_trace_with_a_workload_that_does_not_read_it_is_an_error(
    tmp_path, capsys, command, workload
) -> None:
    # it was ignored: the run replayed the synthetic workload, or the other trace
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    args = [command, "--workload", workload.format(trace=trace), "--trace", str(trace)]
    args += ["--num-requests", "1", "--quiet", "--out", str(tmp_path / "out")]
    if command == "bench":
        args += ["--target", "http://127.0.0.1:9"]
    else:
        args += ["--backends", "1", "--routers", "round_robin", "--no-plots"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"kvroute {command}: --trace" in err and "plain mooncake or azure" in err


@pytest.mark.parametrize("command", ["bench", "compare", "simulate"])
def test_num_requests_must_be_at_least_one(capsys, command) -> None:
    # --num-requests 0 ran nothing and exited 1 without a word
    args = [command, "--workload", "gsp", "--num-requests", "0", "--quiet"]
    if command == "bench":
        args += ["--target", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "argument --num-requests: must be >= 1" in capsys.readouterr().err


def test_bench_says_when_no_request_was_measured(fake_in_thread, tmp_path, capsys) -> None:
    # the warm-up takes every row of the trace: nothing is left to measure
    url, _state = fake_in_thread
    trace = tmp_path / "two.jsonl"
    row = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
    trace.write_text(row * 2)
    args = ["bench", "--target", url, "--workload", f"mooncake:{trace}", "--quiet"]
    assert main([*args, "--num-warmup", "2"]) == 1
    assert "kvroute bench: no request was measured" in capsys.readouterr().err
