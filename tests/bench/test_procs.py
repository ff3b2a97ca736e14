"""ManagedProcess: the one way the harness starts, waits for and stops a child."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvroute.bench.procs import ManagedProcess, cpu_seconds, http_ok, sim_engines

# prints a line, starts a grandchild in its group, then (optionally) ignores SIGTERM
CHILD = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"ready grandchild={grand.pid}", flush=True)
time.sleep(60)
"""


def _child(kind: str, tmp_path: Path) -> ManagedProcess:
    return ManagedProcess(kind, [sys.executable, "-c", CHILD, kind], tmp_path / f"{kind}.log")


def _grandchild(lines: list[str]) -> int:
    return int(lines[0].rsplit("=", 1)[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0): dead, not yet reaped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until(cond, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_stop_sync_ends_the_child_and_its_group(kind: str, tmp_path: Path) -> None:
    proc = _child(kind, tmp_path)
    proc.launch()
    lines = proc.wait_line_sync(r"^ready ", 20)
    grand = _grandchild(lines)
    assert proc.alive and proc.returncode is None
    proc.stop_sync(grace_s=0.5)
    assert not proc.alive and proc.returncode is not None
    assert _until(lambda: _gone(grand)), "the grandchild went with the group"


async def test_async_stop_and_wait_line(tmp_path: Path) -> None:
    proc = _child("stubborn", tmp_path)
    await proc.start()
    grand = _grandchild(await proc.wait_line(r"^ready ", 20))
    await proc.stop(grace_s=0.5)
    assert proc.returncode is not None
    assert _until(lambda: _gone(grand))


def test_waiting_on_a_dead_child_fails_with_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"]
    proc = ManagedProcess("dies", cmd, tmp_path / "dies.log")
    proc.launch()
    with pytest.raises(RuntimeError, match=r"exited \(3\):\nbad flag"):
        proc.wait_line_sync("never printed", 20)
    with pytest.raises(RuntimeError, match="dies exited"):
        proc.wait_ready_sync(["http://127.0.0.1:9/health"], 20)
    proc.stop_sync()


def test_a_line_that_never_comes_times_out(tmp_path: Path) -> None:
    proc = _child("polite", tmp_path)
    proc.launch()
    try:
        with pytest.raises(TimeoutError, match="no line matching"):
            proc.wait_line_sync("never printed", 0.3)
        assert not http_ok("http://127.0.0.1:9/health", 0.5)
        assert cpu_seconds(proc.pid or 0, children=True) >= cpu_seconds(proc.pid or 0) >= 0
    finally:
        proc.stop_sync()


def test_sim_engines_reads_the_lines_kvroute_sim_prints() -> None:
    lines = [
        "backend 1: http://127.0.0.1:8002  kv-events tcp://127.0.0.1:5558  replay tcp://x:6",
        "backend 0: http://127.0.0.1:8001",
    ]
    a, b = sim_engines(lines)
    assert (a.url, a.kv_events, a.kv_replay) == ("http://127.0.0.1:8001", None, None)
    assert (b.url, b.kv_events, b.kv_replay) == (
        "http://127.0.0.1:8002",
        "tcp://127.0.0.1:5558",
        "tcp://x:6",
    )
    with pytest.raises(ValueError, match="missing"):
        sim_engines(lines[:1])


def test_send_signal_reaches_the_child_alone(tmp_path: Path) -> None:
    proc = _child("polite", tmp_path)
    proc.launch()
    grand = _grandchild(proc.wait_line_sync(r"^ready ", 20))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait_sync(10) == -signal.SIGTERM
    assert not _gone(grand), "the rest of its group was not signalled"
    proc.stop_sync()  # the group goes now
    assert _until(lambda: _gone(grand))


def test_fixed_port_ranges_avoid_the_kernels_ephemeral_ports(monkeypatch, tmp_path) -> None:
    from kvroute.bench import procs

    real = procs.Path

    def fake_path(p: str):  # only the kernel's range file is faked
        if p == "/proc/sys/net/ipv4/ip_local_port_range":
            f = tmp_path / "range"
            f.write_text("32768\t60999\n")
            return f
        return real(p)

    monkeypatch.setattr(procs, "Path", fake_path)
    base = procs.free_port_range(24)
    assert base >= 21000 and base + 24 <= 32768  # below the ephemeral range
    # a window inside the ephemeral range is kept as asked (nothing outside it)
    assert 40000 <= procs.free_port_range(8, 40000, 60000) < 60000
