"""``compare``, ``demo`` and ``simulate`` refuse bad settings up front naming the flag
(exit 2), and a router whose fleet fails to start is reported with the child's reason."""

from __future__ import annotations

import pytest

from kvroute.bench.compare import CompareConfig, RouterOutcome, run_compare_async
from kvroute.bench.compare_cli import in_flags
from kvroute.bench.compare_report import format_table
from kvroute.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--profile", "nope"], "unknown engine profile 'nope'; known: "),
        (["demo", "--profile", "nope"], "unknown engine profile 'nope'; known: "),
        (["simulate", "--profile", "nope"], "unknown engine profile 'nope'; known: "),
        (["compare", "--startup-timeout", "0"], "--startup-timeout must be > 0"),
        (["demo", "--startup-timeout", "-1"], "--startup-timeout must be > 0"),
        (["compare", "--backends", "0"], "--backends must be >= 1"),
        (["simulate", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["compare", "--num-warmup", "-1"], "--num-warmup must be >= 0"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag_before_anything_starts(
    argv: list[str], message: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = [] if argv[0] == "demo" else ["--workload", "gsp"]
    assert main([*argv, *workload, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute {argv[0]}: {message}") and "Config." not in err
    assert not (tmp_path / "out").exists()


def test_in_flags_names_the_flag_of_a_config_field() -> None:
    assert in_flags("LoadConfig.request_timeout_s must be > 0") == "--timeout must be > 0"
    assert in_flags("CompareConfig.num_backends must be >= 1") == "--backends must be >= 1"
    assert in_flags("LoadConfig.new_field must be x") == "LoadConfig.new_field must be x"


def test_a_failed_router_shows_the_childs_last_line_in_the_table() -> None:
    error = "RuntimeError: sim for kvroute exited (2):\nusage: ...\nkvroute sim: error: bad"
    text = format_table({"kvroute": RouterOutcome("kvroute", error=error)})
    assert "failed: RuntimeError: sim for kvroute exited (2): kvroute sim: error: bad" in text


async def test_a_fleet_that_does_not_start_is_reported_with_the_childs_reason(tmp_path) -> None:
    config = CompareConfig(
        "gsp",
        ("round_robin",),
        num_backends=1,
        profile="tiny",
        sim_args=("--jitter", "abc"),  # the sim child refuses this and exits 2
        load_overrides={"num_requests": 1},
        log_dir=tmp_path / "logs",
        progress=False,
    )
    said: list[str] = []
    outcomes = await run_compare_async(config, said.append)
    assert outcomes["round_robin"].error is not None
    assert said == [
        "round_robin: failed (RuntimeError: sim for round_robin exited (2): kvroute sim: "
        "error: argument --jitter: invalid float value: 'abc')"
    ]
