"""``kvroute sim`` refuses ports it cannot bind (HTTP, KV events, replays) with one line
that says which and how to choose others, exit 2; no ZMQ or asyncio traceback."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from kvroute.cli import main
from kvroute.sim.server import start_fleet


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_a_kv_port_in_use_is_an_os_error_naming_the_endpoint() -> None:
    with taken_port() as port, pytest.raises(OSError) as info:
        await start_fleet(1, profile="tiny", kv_events=True, kv_port_base=port)
    assert str(info.value) == f"cannot publish KV events on tcp://127.0.0.1:{port}: " + (
        "Address already in use"
    )


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--port-base", "{port}"], "serve HTTP on 127.0.0.1:{port}"),
        (
            ["--kv-events", "--kv-port-base", "{port}"],
            "publish KV events on tcp://127.0.0.1:{port}",
        ),
        (
            ["--kv-events", "--kv-replay", "--kv-replay-port-base", "{port}"],
            "serve KV replays on tcp://127.0.0.1:{port}",
        ),
    ],
)
def test_sim_on_a_port_in_use_is_one_line_and_exit_2(
    flags: list[str], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with taken_port() as port:
        argv = ["sim", "--profile", "tiny", *(f.format(port=port) for f in flags)]
        if "--port-base" not in argv:
            argv += ["--port-base", "0"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute sim: cannot {what.format(port=port)}: Address already in use;")
    assert "--kv-port-base" in err and len(err.splitlines()) == 1


def test_an_unknown_profile_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--profile", "nope", "--port-base", "0"]) == 2
    assert capsys.readouterr().err.startswith("kvroute sim: unknown engine profile 'nope'")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--port-base", "65534", "--backends", "3"], "--port-base 65534 with 3 backends"),
        (["--kv-events", "--kv-port-base", "65535", "--backends", "2"], "--kv-port-base 65535"),
        (["--port-base", "-5"], "--port-base -5"),
    ],
)
def test_ports_past_65535_are_refused(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The third engine of ``--port-base 65534 --backends 3`` went to a random port."""
    assert main(["sim", "--profile", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "choose a base from 1 to" in err
