"""``kvroute serve`` refuses what it cannot start with one line naming the flag and exit 2.

A listen address in use, not of this machine or not resolvable (API, admin and the
``--workers`` supervisor's reserved ports), a bad ``--log-level``, and ``--print-config``
given what serve itself would refuse: no Python traceback on the way.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator

import pytest

from kvroute.bench.procs import KVROUTE
from kvroute.cli import main
from kvroute.router.app import make_app
from kvroute.router.config import ServerConfig
from kvroute.router.listener import ListenError, start_listeners
from tests.router.conftest import router_config

BACKEND = "http://127.0.0.1:9"


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on (without SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("api", "the port is in use; stop what listens there or choose another --port"),
        ("admin", "the port is in use; stop what listens there or choose another --admin-port"),
        ("host", "192.0.2.1 is not an address of this machine; fix --host"),
    ],
)
async def test_a_listener_that_cannot_bind_names_its_flag(where: str, message: str) -> None:
    with taken_port() as port:
        changes = {
            "api": {"port": port},
            "admin": {"port": 0, "server": ServerConfig(admin_port=port)},
            "host": {"port": 0, "host": "192.0.2.1"},  # TEST-NET-1: no DNS, not ours
        }[where]
        config = router_config([BACKEND], **changes)  # type: ignore[arg-type]
        with pytest.raises(ListenError) as info:
            await start_listeners(make_app(config), config)
    assert message in str(info.value) and "Errno" not in str(info.value)


def test_serve_on_a_port_in_use_is_one_line_and_exit_2() -> None:
    with taken_port() as port:
        cmd = [*KVROUTE, "serve", "--backend", BACKEND, "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    # the last line says it (the backend's health may be logged before: it is dead too)
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"kvroute serve: cannot listen on 127.0.0.1:{port}: the port is in use; "
        "stop what listens there or choose another --port"
    )


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
def test_workers_on_a_port_in_use_exit_2_naming_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with taken_port() as port:
        argv = ["serve", "--backend", BACKEND, "--workers", "2", "--port", "0", flag, str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute serve: cannot listen on 127.0.0.1:{port}")
    assert err.rstrip().endswith(f"choose another {flag}")


def test_log_level_is_a_choice_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--backend", BACKEND, "--log-level", "LOUD"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid choice: 'LOUD'" in err and "Traceback" not in err
    assert main(["serve", "--backend", BACKEND, "--log-level", "info", "--print-config"]) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "workers: must be in [1, 256], got 0"),
        (["--workers", "-2"], "workers: must be in [1, 256], got -2"),
        (["--workers", "2", "--worker-port-base", "65535"], "worker_port_base: 65535"),
    ],
)
def test_print_config_refuses_worker_flags_serve_refuses(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--backend", BACKEND, *flags, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvroute serve: {message}") and not captured.out


def test_print_config_without_backends_prints_and_says_serve_would_refuse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--print-config"]) == 0  # a fragment, as compare --router-config
    captured = capsys.readouterr()
    assert "policy: prefix" in captured.out
    assert captured.err.startswith("kvroute serve: note: serve would refuse this: backends:")
