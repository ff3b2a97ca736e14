"""``soak`` and ``chaos`` refuse flags out of range with argparse's one line naming the
flag (exit 2) before anything starts, and so does an ``--out`` that cannot be a folder;
a child that fails to start is reported by its own last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.bench.cli_args import make_out_dir
from kvroute.bench.procs import error_line
from kvroute.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["soak", "--duration", "0"], "argument --duration: must be a number > 0, got '0'"),
        (["soak", "--duration", "inf"], "argument --duration: must be a finite number"),
        (["soak", "--sample-s", "-1"], "argument --sample-s: must be a number > 0"),
        (["soak", "--restart-every-s", "-1"], "argument --restart-every-s: must be a number >= 0"),
        (["soak", "--backends", "0"], "argument --backends: must be an integer >= 2, got '0'"),
        (["soak", "--users", "0"], "argument --users: must be an integer >= 1, got '0'"),
        (["soak", "--profile", "nope"], "argument --profile: unknown engine profile 'nope'"),
        (["chaos", "--duration", "0"], "argument --duration: must be a number > 0, got '0'"),
        (["chaos", "--duration", "abc"], "argument --duration: expected a number, got 'abc'"),
        (["chaos", "--backends", "0"], "argument --backends: must be an integer >= 2, got '0'"),
        (["chaos", "--users", "0"], "argument --users: must be an integer >= 1, got '0'"),
    ],
)
def test_soak_and_chaos_flags_out_of_range_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"kvroute {argv[0]}: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["soak", "chaos"])
def test_an_out_that_is_a_file_is_refused_before_the_run(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "result.json"
    a_file.write_text("{}")
    assert main([command, "--out", str(a_file)]) == 2
    assert capsys.readouterr().err == (
        f"kvroute {command}: --out {a_file}: is a file, not a folder; give a folder to write into\n"
    )


def test_make_out_dir_creates_parents_and_refuses_what_cannot_be_a_folder(
    tmp_path: Path,
) -> None:
    assert make_out_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="cannot create it"):
        make_out_dir(tmp_path / "f" / "sub")  # a parent is a file


def test_error_line_ends_with_the_childs_own_last_line() -> None:
    exc = RuntimeError("sim for round_robin exited (2):\nstarting\nkvroute sim: unknown profile\n")
    assert error_line(exc) == (
        "RuntimeError: sim for round_robin exited (2): kvroute sim: unknown profile"
    )
    assert error_line(TimeoutError("no answer in 5 s")) == "TimeoutError: no answer in 5 s"
    assert error_line(OSError()) == "OSError"
