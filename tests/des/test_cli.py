"""``kvroute simulate`` from the command line: compare's outputs, the ceilings, speed.json."""

from __future__ import annotations

import json

import pytest

from kvroute.cli import main
from tests.bench.test_cli import DESIGN_KEYS

from .helpers import SMALL


def test_help_names_the_simulator(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-event-delay-ms" in out and "virtual time" in out


def test_a_small_run_writes_compares_outputs_and_the_ceilings(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--workload", "gsp", "--backends", "3", "--num-requests", "50"]
    args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
    args += ["--routers", "round_robin,kvroute,sglang", "--out", str(out), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "simulated: times are engine time" in printed
    assert "Belady" in printed and "x real time" in printed
    data = json.loads((out / "compare.json").read_text())
    assert "runs only in `kvroute compare`" in data["sglang"]["skipped"]
    for name in ("round_robin", "kvroute"):
        result = data[name]
        assert set(result) >= DESIGN_KEYS | {"belady_hit_rate", "pooled_lru_hit_rate"}
        assert result["completed"] == 50
        assert result["engine_prefix_hit_rate"] <= result["belady_hit_rate"]
    assert data["kvroute"]["decision_analysis"]
    assert (out / "compare_ttft_cdf.png").exists() and (out / "kvroute" / "records.jsonl").exists()
    speed = json.loads((out / "speed.json").read_text())
    assert speed["kvroute"]["requests"] == 50 and speed["kvroute"]["x_real_time"] > 0


def test_no_ceilings_leaves_them_out_of_the_report(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--workload", "gsp", "--backends", "3", "--num-requests", "30"]
    args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
    args += ["--routers", "kvroute", "--out", str(out), "--quiet", "--no-plots", "--no-ceilings"]
    assert main(args) == 0
    assert "Belady" not in capsys.readouterr().out
    result = json.loads((out / "compare.json").read_text())["kvroute"]
    assert result["belady_hit_rate"] is None and result["engine_prefix_hit_rate"] > 0


def test_a_router_config_is_what_the_simulated_router_runs_with(tmp_path, capsys) -> None:
    def run(*extra: str) -> dict:
        out = tmp_path / f"run{len(extra)}"
        args = ["simulate", "--workload", "gsp", "--backends", "3", "--num-requests", "40"]
        args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
        args += ["--routers", "kvroute", "--out", str(out), "--quiet", "--no-plots", *extra]
        assert main(args) == 0
        return json.loads((out / "compare.json").read_text())["kvroute"]

    config = tmp_path / "tiny-index.yaml"
    config.write_text("fleet: {max_index_entries: 4}\n")  # forgets nearly every prefix
    default, tiny = run(), run("--router-config", str(config))
    assert tiny["config"]["router_config"] == str(config)
    assert tiny["engine_prefix_hit_rate"] < default["engine_prefix_hit_rate"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("policy: round_robin\n", "sets policy: round_robin, but the router kvroute runs"),
        ("backends: [http://127.0.0.1:9]\n", "lists backends"),
        ("fleet: {max_index_entries: -1}\n", "fleet.max_index_entries"),
    ],
)
def test_a_router_config_the_run_cannot_use_is_refused_before_it(
    tmp_path, capsys, text: str, said: str
) -> None:
    """A policy in the file was silently overridden by the router's name; a file with
    backends (or a bad value) was a traceback from inside the run."""
    config = tmp_path / "router.yaml"
    config.write_text(text)
    args = ["simulate", "--workload", "gsp", "--backends", "2", "--num-requests", "10"]
    args += ["--routers", "kvroute", "--router-config", str(config), "--out", str(tmp_path)]
    assert main([*args, "--quiet", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute simulate: ") and said in err
    assert not (tmp_path / "compare.json").exists()


def test_a_bad_workload_is_a_usage_error(capsys) -> None:
    assert main(["simulate", "--workload", "nope", "--quiet", "--no-plots"]) == 2
    assert "nope" in capsys.readouterr().err


def test_backend_urls_name_the_backends_and_must_match_their_number(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--workload", "gsp", "--backends", "2", "--num-requests", "10"]
    args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
    args += ["--routers", "consistent_hash", "--out", str(out), "--quiet", "--no-plots"]
    assert main([*args, "--backend-urls", "http://a:1,http://b:2"]) == 0
    rows = json.loads((out / "compare.json").read_text())["consistent_hash"]["per_backend"]
    assert {row["backend"] for row in rows} <= {"http://a:1", "http://b:2"}
    assert main([*args, "--backend-urls", "http://a:1"]) == 2
    assert "--backend-urls names 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    [
        "--duration",
        "--think-time",
        "--kv-event-delay-ms",
        "--request-overhead-ms",
        "--slo-ttft-p99",
        "--gpu-cost-per-hour",
    ],
)
def test_a_non_finite_number_is_a_usage_error(capsys, flag) -> None:
    # --duration inf and --request-overhead-ms inf ran forever; nan gave nan times
    for value in ("inf", "nan"):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "--workload", "gsp", "--quiet", "--no-plots", f"{flag}={value}"])
        assert exc.value.code == 2
        assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


def test_a_run_that_measures_no_request_says_so(tmp_path, capsys) -> None:
    # the warm-up takes every row of the trace: the table was all n/a, exit 1, no word why
    trace = tmp_path / "two.jsonl"
    row = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
    trace.write_text(row * 2)
    args = ["simulate", "--workload", f"mooncake:{trace}", "--backends", "1", "--num-warmup", "2"]
    args += ["--routers", "round_robin", "--out", str(tmp_path / "run"), "--quiet", "--no-plots"]
    assert main(args) == 1
    assert "kvroute simulate: round_robin: no request was measured" in capsys.readouterr().err


def _gsp(tmp_path, *more: str) -> list[str]:
    args = ["simulate", "--workload", "gsp", "--backends", "1", "--duration", "20"]
    args += [f"--workload-arg={k}={v}" for k, v in SMALL["gsp"].items()]
    return [*args, "--routers", "round_robin", "--out", str(tmp_path), "--quiet", "--no-plots",
            *more]  # fmt: skip


def test_a_rate_asked_for_is_offered_and_the_header_says_so(tmp_path, capsys) -> None:
    """gsp keeps 16 requests in flight at its own rate; an explicit --rate was held to
    that cap too, silently, so a plan answered for traffic never sent."""
    assert main(_gsp(tmp_path / "a", "--rate", "50")) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "offered" in line)
    assert header.startswith("gsp on 1 x") and "50 req/s offered," in header
    load = json.loads((tmp_path / "a" / "compare.json").read_text())["round_robin"]
    assert load["config"]["load"]["max_concurrency"] is None
    assert main(_gsp(tmp_path / "b", "--rate", "50", "--max-concurrency", "4")) == 0
    assert "50 req/s offered (at most 4 in flight)" in capsys.readouterr().out


def test_think_time_with_a_rate_is_refused(tmp_path, capsys) -> None:
    assert main(_gsp(tmp_path, "--rate", "5", "--think-time", "1,2")) == 2
    assert "--think-time" in capsys.readouterr().err


def test_a_run_whose_requests_all_failed_shows_no_ttft_and_says_why(tmp_path, capsys) -> None:
    """b2b does not fit codellama-13b's context: the table showed TTFT 0 ms, no reason."""
    args = ["simulate", "--workload", "b2b", "--backends", "1", "--num-requests", "5"]
    args += ["--routers", "round_robin", "--out", str(tmp_path), "--quiet", "--no-plots"]
    assert main(args) == 1
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("round_robin"))
    assert row.count("n/a") >= 2
    assert "Failed requests by reason" in printed and "max_model_len" in printed


def _trace(tmp_path, rows: list[str]):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(r + "\n" for r in rows))
    return path


def test_quantised_timestamps_are_spread_and_the_run_says_so(tmp_path, capsys) -> None:
    """Two bursts of rows at t=0 and t=60 s were spread over 60 s each, silently."""
    row = '{"timestamp": %d, "input_length": 100, "output_length": 2, "hash_ids": [%d]}'
    trace = _trace(tmp_path, [row % (t, i) for t in (0, 60000) for i in range(6)])
    args = ["simulate", "--workload", f"mooncake:{trace}", "--backends", "1"]
    args += ["--routers", "round_robin", "--quiet", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "quantised to 60000 ms" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "b"), "--workload-arg", "spread_ms=0"]) == 0
    assert "quantised" not in capsys.readouterr().err


def test_a_row_longer_than_its_blocks_is_sent_at_its_length(tmp_path, capsys) -> None:
    """input_length 4,000 behind one 512-token block was sent as 1,024 tokens."""
    trace = _trace(tmp_path, ['{"timestamp": 0, "input_length": 4000, "output_length": 1, '
                              '"hash_ids": [1]}'])  # fmt: skip
    out = tmp_path / "run"
    args = ["simulate", "--workload", f"mooncake:{trace}", "--backends", "1"]
    run = [*args, "--routers", "round_robin", "--out", str(out), "--quiet", "--no-plots"]
    assert main(run) == 0
    capsys.readouterr()
    result = json.loads((out / "compare.json").read_text())["round_robin"]
    assert result["total_input_tokens"] == 4000


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--backends", "2", "--backend-urls", "http://a:1,http://a:1"], "twice"),
        (["--backends", "2", "--backend-urls", "a b,http://c:1"], "backend"),
        (["--workload-arg", "input_scale=inf"], "input_scale"),
    ],
)
def test_bad_trace_and_url_options_are_one_line_errors(tmp_path, capsys, extra, said) -> None:
    trace = _trace(tmp_path, ['{"timestamp": 0, "input_length": 10, "output_length": 1, '
                              '"hash_ids": [1]}'])  # fmt: skip
    args = ["simulate", "--workload", f"mooncake:{trace}", "--routers", "round_robin"]
    assert main([*args, *extra, "--out", str(tmp_path / "r"), "--quiet", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_profile_number_yaml_reads_as_text_says_how_to_write_it() -> None:
    from kvroute.engine.profiles import _check_float

    with pytest.raises(ValueError, match=r"write it 1.0e-06, unquoted"):
        _check_float("c_ms_per_pair", "1e-6")


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--slo-ttft-p99", "1"], "--slo-ttft-p99: only with --plan"),
        (["--max-backends", "4"], "--max-backends: only with --plan"),
        (["--plan", "--slo-ttft-p99", "1", "--gpu-cost-per-hour", "2", "--no-ceilings"],
         "--no-ceilings: not used by --plan"),
    ],
)  # fmt: skip
def test_options_a_run_would_ignore_are_refused(tmp_path, capsys, extra, said) -> None:
    args = ["simulate", "--workload", "gsp", "--routers", "round_robin", "--quiet"]
    assert main([*args, *extra, "--out", str(tmp_path), "--no-plots"]) == 2
    assert said in capsys.readouterr().err


def test_a_trace_after_its_warm_up_starts_at_its_first_measured_row(tmp_path, capsys) -> None:
    """The measured rows kept their trace offsets: 100 warm-up rows 250 ms apart left a
    25-s idle gap at the start of the measured run and halved its req/s."""
    row = '{"timestamp": %d, "input_length": 50, "output_length": 1, "hash_ids": [%d]}'
    trace = _trace(tmp_path, [row % (250 * i, i) for i in range(40)])
    args = ["simulate", "--workload", f"mooncake:{trace}", "--backends", "1", "--num-warmup"]
    args += ["20", "--routers", "round_robin", "--quiet", "--no-plots", "--out", str(tmp_path)]
    assert main(args) == 0
    capsys.readouterr()
    lines = (tmp_path / "round_robin" / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    starts = sorted(r["start_s"] for r in records if not r.get("warmup"))
    assert len(starts) == 20 and starts[0] < 0.1
