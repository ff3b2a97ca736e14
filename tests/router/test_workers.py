"""``kvroute serve --workers N``: several router processes on one port, supervised.

The router runs as a real subprocess (the supervisor spawns its workers) in front of a
``kvroute sim`` subprocess with two ``tiny`` engines; requests use a fresh connection
each, so the kernel's SO_REUSEPORT hash spreads them over the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from kvroute.bench.procs import KVROUTE, SIM_LINE, ManagedProcess, sim_engines
from kvroute.cli import main
from kvroute.core.fleet import Fleet
from kvroute.core.policy.base import RouteRequest
from kvroute.router.app import build_fleet
from kvroute.router.worker_sync import BusSpec, FleetBus
from kvroute.router.workers import (
    BUS_DIR_PREFIX,
    WORKER_HEADER,
    SupervisorConfig,
    reserve_port,
    sweep_stale_bus_dirs,
)
from tests.conftest import until

ADMIN_KEY = "workers-test"


def start(name: str, cmd: list[str], logs: Path) -> ManagedProcess:
    proc = ManagedProcess(name, cmd, logs / f"{name}.log")
    proc.launch()
    return proc


def stop(proc: ManagedProcess, timeout_s: float = 20) -> int:
    """SIGTERM to the supervisor alone (it must stop its own workers): its exit code. Its
    group is killed only if it did not exit, so a worker it left behind stays visible."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait_sync(timeout_s)
    finally:
        if proc.alive:
            proc.stop_sync()


@pytest.fixture(scope="module")
def sim_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    cmd = [*KVROUTE, "sim", "--backends", "2", "--profile", "tiny", "--speedup", "100",
           "--port-base", "0"]  # fmt: skip
    proc = start("sim", cmd, tmp_path_factory.mktemp("sim"))
    try:
        yield [e.url for e in sim_engines(proc.wait_line_sync(SIM_LINE, 30, count=2))]
    finally:
        stop(proc)


@pytest.fixture
def router(sim_urls: list[str], tmp_path: Path) -> Iterator[tuple[ManagedProcess, int]]:
    """``kvroute serve --workers 2`` on a free port: (the supervisor process, the port)."""
    cmd = [*KVROUTE, "serve", "--workers", "2", "--port", "0", "--policy", "prefix",
           "--drain-timeout", "5", "--admin-key", ADMIN_KEY]  # fmt: skip
    for url in sim_urls:
        cmd += ["--backend", url]
    proc = start("router", cmd, tmp_path)
    try:
        (line,) = proc.wait_line_sync(r"listening on", 60)
        port = int(re.search(r":(\d+) ", line).group(1))  # type: ignore[union-attr]
        yield proc, port
    finally:
        stop(proc)


def complete(port: int, prompt: str) -> tuple[int, str, str, str]:
    """One completion on a fresh connection: (status, worker, backend, decision)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        headers = [resp.getheader(h) or "" for h in (WORKER_HEADER, "x-kvroute-backend")]
        return resp.status, *headers, resp.getheader("x-kvroute-decision") or ""
    finally:
        conn.close()


def workers_seen(port: int, num_requests: int) -> dict[int, int]:
    """Worker index -> pid over ``num_requests`` fresh connections (errors skipped)."""
    seen: dict[int, int] = {}
    for i in range(num_requests):
        try:
            status, worker, _, _ = complete(port, f"request {i}: tell me about the sea")
        except OSError:
            continue  # a connection queued at a worker that was just killed
        assert status == 200
        index, pid = worker.split(":")
        seen[int(index)] = int(pid)
    return seen


def children_of(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def all_gone(pids: set[int], timeout_s: float = 5.0) -> bool:
    """True once none of ``pids`` runs any more (dead or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


def backend_rows(port: int) -> tuple[str, list[dict[str, object]]]:
    """``GET /admin/backends`` on a fresh connection: (worker index, its rows)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        resp = conn.getresponse()
        rows = json.loads(resp.read())["backends"]
        return (resp.getheader(WORKER_HEADER) or "").split(":")[0], rows
    finally:
        conn.close()


def wait_until_both_idle(port: int, timeout_s: float = 20.0) -> None:
    """Until each worker has seen every request finish, its own and its peer's.

    A finish travels on the bus after its dispatch, so a worker idle here has also heard
    of the placement; asked earlier, it may still count the other's request in flight and
    balance away from the prefix, which is right but not what this test is about.
    """
    deadline = time.monotonic() + timeout_s
    idle: set[str] = set()
    while time.monotonic() < deadline:
        worker, rows = backend_rows(port)
        if all(r["kvroute_backend_router_in_flight_requests"] == 0 for r in rows):
            idle.add(worker)
            if len(idle) == 2:
                return
        time.sleep(0.02)
    raise AssertionError(f"only workers {sorted(idle)} went idle within {timeout_s} s")


def blocks_per_worker(port: int, timeout_s: float = 20.0) -> dict[str, dict[str, int]]:
    """Worker index -> (backend -> blocks its index holds), once both have answered."""
    deadline = time.monotonic() + timeout_s
    views: dict[str, dict[str, int]] = {}
    while len(views) < 2 and time.monotonic() < deadline:
        worker, rows = backend_rows(port)
        views[worker] = {str(r["url"]): int(r["kvroute_backend_index_blocks"]) for r in rows}
    assert len(views) == 2, f"only workers {sorted(views)} answered"
    return views


def assert_workers_share_a_prefix(port: int, timeout_s: float = 20.0) -> None:
    """A prefix routed by one worker is a hit at the other once the message is there.

    No warm-up: the supervisor says "listening" only after every worker heard its peers,
    so the very first placement reaches the other worker.
    """
    prompt = "Shared system prompt about tides and harbours. " * 30
    before = blocks_per_worker(port)
    _, first_worker, backend, _ = complete(port, prompt + "first")
    other = next(w for w in before if w != first_worker.split(":")[0])
    deadline = time.monotonic() + timeout_s
    while (now := blocks_per_worker(port))[other][backend] <= before[other][backend]:
        assert time.monotonic() < deadline, f"worker {other} never heard: {before} {now}"
        time.sleep(0.02)
    others = []
    for i in range(30):
        wait_until_both_idle(port)
        status, worker, got, decision = complete(port, prompt + f"question {i}")
        assert status == 200
        if worker.split(":")[0] == other:
            others.append((got, decision))
    assert others, "no request reached the other worker"
    assert all(o == (backend, "prefix") for o in others), (backend, others)


def test_two_workers_serve_restart_and_drain(router: tuple[ManagedProcess, int]) -> None:
    """Both workers answer; a killed one comes back with a new pid; SIGTERM ends all, 0."""
    proc, port = router
    before = workers_seen(port, 24)
    assert set(before) == {0, 1}, f"both workers answer: {before}"
    assert len(set(before.values())) == 2
    assert proc.pid is not None and set(before.values()) <= children_of(proc.pid)
    assert_workers_share_a_prefix(port)
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    after: dict[int, int] = {}
    while time.monotonic() < deadline and after.get(0, before[0]) == before[0]:
        after = workers_seen(port, 8)
        time.sleep(0.1)
    assert after.get(0) not in (None, before[0]), "worker 0 came back with a new pid"
    assert after.get(1, before[1]) == before[1], "worker 1 was left alone"
    children = children_of(proc.pid)
    assert after[0] in children
    assert stop(proc) == 0
    assert all_gone(children), "a child outlived the supervisor"


def test_reserved_port_is_shared_by_reuseport_listeners() -> None:
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    listeners = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            listeners.append(s)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # accepted into one of the listeners' queues
    finally:
        for s in [reserved, *listeners]:
            s.close()


@pytest.mark.parametrize(
    "changes",
    [
        {"num_workers": 0},
        {"num_workers": 2, "private_port_base": 65535},
        {"num_workers": 2, "backoff_initial_s": 0},
    ],
)
def test_supervisor_config_rejects_bad_values(changes: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SupervisorConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "extra", [["--workers", "0"], ["--workers", "2", "--policy", "no-such-policy"]]
)
def test_bad_worker_flags_exit_2_without_spawning(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--backend", "http://127.0.0.1:9", "--port", "0", *extra]
    assert main(argv) == 2
    assert "kvroute serve:" in capsys.readouterr().err


@contextlib.asynccontextmanager
async def bus_pair(
    tmp_path: Path, fleets: list[Fleet], **spec: float
) -> AsyncIterator[list[FleetBus]]:
    """Two FleetBuses (workers 0 and 1) on ``fleets``, receiving and sending heartbeats."""
    context = zmq.asyncio.Context()
    specs = [BusSpec(str(tmp_path), i, 2, **spec) for i in range(2)]
    buses = [FleetBus(sp, fleet, context) for sp, fleet in zip(specs, fleets, strict=True)]
    for bus in buses:
        bus.install()
    tasks = [asyncio.create_task(b.receive_forever()) for b in buses]
    tasks += [asyncio.create_task(b.heartbeat_forever()) for b in buses]
    try:
        yield buses
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bus in buses:
            bus.close()
        context.term()


async def test_fleet_bus_replicates_a_peers_requests(tmp_path: Path) -> None:
    """Worker 0 dispatches; worker 1 then holds the prefix on the same backend and counts
    the load until worker 0 finishes; a peer that restarts has its shadows released."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    fleets = [build_fleet("prefix") for _ in range(2)]
    for fleet in fleets:
        for url in urls:
            fleet.add_backend(url)
    req = RouteRequest("r1", None, [11, 12, 13, 14], 64, 4)

    def in_flight(fleet: Fleet) -> dict[str, int]:
        return {s.url: s.in_flight_requests for s in fleet.backend_states()}

    async with bus_pair(tmp_path, fleets) as buses:
        first = fleets[0].route(req, 0.0)
        assert first is not None
        assert await buses[1].wait_connected(10.0)  # PUB drops messages until then
        ticket = fleets[0].dispatch(first, req, 0.0)
        await until(lambda: in_flight(fleets[1])[first.backend] == 1)  # load shared
        fleets[0].on_first_token(ticket, 0.5, 48)
        fleets[0].finish(ticket, 1.0, True)
        await until(lambda: in_flight(fleets[1])[first.backend] == 0)
        second = fleets[1].route(req, 1.0)
        assert second is not None
        assert (second.backend, second.reason) == (first.backend, "prefix")  # index shared
        assert not buses[1].peers[0].shadows
        assert not buses[0].peers or not buses[0].peers[1].shadows, "nobody replays itself"
        # worker 0 dispatches again, then "restarts": a message with a new pid
        fleets[0].dispatch(first, req, 2.0)
        await until(lambda: in_flight(fleets[1])[first.backend] == 1)
        buses[1].apply(msgspec.msgpack.encode([(4, 0, buses[0].pid + 1)]), 3.0)
        assert in_flight(fleets[1])[first.backend] == 0
        buses[1].apply(b"not msgpack", 3.0)  # dropped with a warning
        for fleet in fleets:
            fleet.check_invariants()


async def test_fleet_bus_join_handshake(tmp_path: Path) -> None:
    """Fast heartbeats until every worker hears every other, slow ones after; a peer that
    restarts makes the others fast again until it hears them; strangers are dropped."""
    fleets = [build_fleet("prefix") for _ in range(2)]
    async with bus_pair(tmp_path, fleets, heartbeat_s=60.0, join_heartbeat_s=0.01) as buses:
        assert all([await b.wait_connected(10.0) for b in buses])
        await until(lambda: all(b.settled for b in buses))
        sent = [b.num_sent for b in buses]
        await asyncio.sleep(0.2)
        assert all(b.num_sent - n <= 1 for b, n in zip(buses, sent, strict=True)), "slow now"
        buses[1].apply(msgspec.msgpack.encode([(4, 0, buses[0].pid + 1, False)]), 1.0)
        assert buses[1].connected and not buses[1].settled  # the restarted peer hears nobody
        buses[1].apply(msgspec.msgpack.encode([(4, 7, 1, True)]), 1.0)  # no worker 7
        assert set(buses[1].peers) == {0}


async def test_fleet_bus_carries_the_session_with_a_dispatch(tmp_path: Path) -> None:
    """A session placed by worker 0 has the same home in worker 1's table (its next
    turn may land on either); a dispatch without a session records none."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    fleets = [build_fleet("least_load") for _ in range(2)]
    for fleet in fleets:
        for url in urls:
            fleet.add_backend(url, models=["m"])
    with_session = RouteRequest("r1", "m", [11, 12], 64, 4, session="chat-7")
    without = RouteRequest("r2", "m", [21, 22], 64, 4)
    async with bus_pair(tmp_path, fleets) as buses:
        assert await buses[1].wait_connected(10.0)
        first = fleets[0].route(with_session, 0.0)
        assert first is not None
        t1 = fleets[0].dispatch(first, with_session, 0.0)
        second = fleets[0].route(without, 0.0)
        assert second is not None
        t2 = fleets[0].dispatch(second, without, 0.0)
        await until(lambda: fleets[1].num_sessions(0.0) == 1)
        assert fleets[1].session_backend(with_session, 0.0) == first.backend
        fleets[0].finish(t1, 1.0, True)
        fleets[0].finish(t2, 1.0, True)
        await until(lambda: not buses[1].peers[0].shadows)
        assert fleets[1].num_sessions(1.0) == 1
        for fleet in fleets:
            fleet.check_invariants()


async def test_fleet_bus_records_no_blocks_of_a_prompt_the_engine_will_refuse(
    tmp_path: Path,
) -> None:
    """A dispatch over the context counts as load in every worker and enters no worker's
    cache model (its keys travel for the load's cached share, its flag says not to record)."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    fleets = [build_fleet("prefix") for _ in range(2)]
    for fleet in fleets:
        for url in urls:
            fleet.add_backend(url)
    refused = RouteRequest("r1", None, [31, 32, 33], 64, 4, cacheable=False)
    async with bus_pair(tmp_path, fleets) as buses:
        assert await buses[1].wait_connected(10.0)
        decision = fleets[0].route(refused, 0.0)
        assert decision is not None
        ticket = fleets[0].dispatch(decision, refused, 0.0)
        await until(lambda: bool(buses[1].peers[0].shadows))
        assert [f.index.num_blocks(decision.backend) for f in fleets] == [0, 0]
        fleets[0].finish(ticket, 1.0, True)
        await until(lambda: not buses[1].peers[0].shadows)
        for fleet in fleets:
            fleet.check_invariants()


def test_bus_folders_of_dead_supervisors_are_swept_and_nothing_else(tmp_path: Path) -> None:
    """A supervisor killed with SIGKILL leaves its ipc folder; the next one removes it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now (reuse within the test is unlikely)
    stale = tmp_path / f"{BUS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{BUS_DIR_PREFIX}{os.getpid()}-abc"
    names = [f"{BUS_DIR_PREFIX}{dead.pid}", f"{dead.pid}-abc", "kvroute-cost-1-x",
             f"{BUS_DIR_PREFIX}x{dead.pid}-abc"]  # fmt: skip
    others = [tmp_path / name for name in names]
    for folder in (stale, live, *others):
        folder.mkdir()
    (stale / "bus-0.ipc").write_text("")
    assert sweep_stale_bus_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and all(p.exists() for p in others)
