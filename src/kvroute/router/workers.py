"""``kvroute serve --workers N``: N router processes on one port, one supervisor.

Why processes: one Python event loop tops out at one core; the router's work per request
(JSON, hashing, routing, relaying) is CPU-bound, so more throughput needs more processes.

How: the supervisor reserves the listen port with a bound, non-listening socket that has
``SO_REUSEPORT`` (so ``--port 0`` yields one port for everybody and a restarted worker
finds the port still free for it), then spawns N workers. Each worker is a whole router:
its own event loop, aiohttp app, upstream pool, health loop, scraper and ``Fleet`` (index
and load), listening on the shared port with ``SO_REUSEPORT``; the kernel spreads new
connections over the listening workers by a hash of the connection's addresses. The
workers replicate each other's Fleet calls over a local ZMQ bus (``worker_sync.py``), so
each one holds the index and load that one process handling all the host's requests
would hold; the rendezvous tie-break then makes them decide alike. ``--no-worker-sync``
turns that off (each worker learns only from its own requests; measured: the engine hit
rate falls with the number of workers). In exact mode every worker also subscribes to
the same KV events.

The supervisor restarts a worker that dies (backoff 0.5 s doubling to 10 s, reset after
a worker ran 30 s) and on SIGTERM/SIGINT sends SIGTERM to every worker, which drains
like the single process does (listener closed, /health 503, in-flight requests get
``drain_timeout_s``); it exits 0 once all have exited cleanly. A worker dies with its
supervisor (Linux parent-death signal). Every response carries ``x-kvroute-worker:
INDEX:PID``. ``/metrics``, ``/``, ``/health`` and ``/admin`` answer for the worker that
took the connection; ``--worker-port-base P`` also serves worker i alone on port P+i, so
Prometheus can scrape each worker (see docs/deploy.md). With ``server.admin_port`` the
operator endpoints move to that port, which the supervisor reserves like the main one and
every worker shares; worker ports then serve only those. Client timeouts and the
connection cap (``server:``) hold per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from aiohttp import web

from kvroute.router.app import build_fleet, make_app
from kvroute.router.config import RouterConfig
from kvroute.router.listener import ensure_fd_limit, naming_flags, start_listeners
from kvroute.router.worker_sync import BUS, BusSpec, attach_bus

log = logging.getLogger("kvroute.router.workers")
WORKER_HEADER = "x-kvroute-worker"
BUS_JOIN_TIMEOUT_S = 10.0  # a worker reports ready without its peers after this long


BUS_DIR_PREFIX = "kvroute-workers-"  # + the supervisor's pid + "-" + mkdtemp's suffix


def sweep_stale_bus_dirs(folder: str) -> list[str]:
    """Remove the bus folders (ipc sockets only) of supervisors that are gone: one killed
    with SIGKILL could not remove its own. Returns the paths removed."""
    removed = []
    for entry in os.scandir(folder):
        pid_text, sep, _ = entry.name.removeprefix(BUS_DIR_PREFIX).partition("-")
        named = entry.name.startswith(BUS_DIR_PREFIX) and sep and pid_text.isdigit()
        if not named or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat().st_uid != os.getuid() or _alive(int(pid_text)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's, or not a pid we can judge: leave it
    return True


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How the supervisor runs and restarts its workers."""

    num_workers: int  # router processes sharing the port, >= 1
    private_port_base: int | None = None  # worker i also listens alone on this + i
    log_level: str = "WARNING"  # python logging level inside the workers
    share_decisions: bool = True  # workers tell each other their dispatches (worker_sync)
    start_timeout_s: float = 60.0  # a worker not ready by then counts as failed
    backoff_initial_s: float = 0.5  # delay before the first restart of a crashed worker
    backoff_max_s: float = 10.0  # the delay doubles per crash up to this
    stable_after_s: float = 30.0  # a worker that ran this long resets its backoff
    kill_grace_s: float = 5.0  # after drain_timeout_s, stragglers are killed

    def __post_init__(self) -> None:
        if not 1 <= self.num_workers <= 256:
            raise ValueError(f"workers: must be in [1, 256], got {self.num_workers}")
        base = self.private_port_base
        if base is not None and not 1 <= base <= 65535 - self.num_workers + 1:
            raise ValueError(f"worker_port_base: {base} + workers must fit in [1, 65535]")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("backoff: need 0 < backoff_initial_s <= backoff_max_s")


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket: fixes the port (0 -> a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------- worker process side


def worker_main(
    config: RouterConfig,
    index: int,
    private_port: int | None,
    bus: BusSpec | None,
    log_level: str,
    ready: Connection,
) -> None:
    """Entry point of one worker process (multiprocessing spawn target)."""
    _die_with_parent()
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(name)s [worker {index}] %(message)s"
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    asyncio.run(serve_worker(config, index, private_port, bus, ready))


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the supervisor dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def worker_header_hook(value: str) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An on_response_prepare hook that stamps every response with this worker."""

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = value

    return stamp


async def serve_worker(
    config: RouterConfig,
    index: int,
    private_port: int | None,
    bus: BusSpec | None,
    ready: Connection,
) -> None:
    """One worker: the router app on the shared port (SO_REUSEPORT); drain on SIGTERM."""
    ensure_fd_limit(config)
    app = make_app(config)
    app.on_response_prepare.append(worker_header_hook(f"{index}:{os.getpid()}"))
    if bus is not None:
        attach_bus(app, bus)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # the shared ports (API, admin) with SO_REUSEPORT; each worker guards its own clients
    listeners = await start_listeners(app, config, reuse_port=True, private_port=private_port)
    try:
        if bus is not None and not await app[BUS].wait_connected(BUS_JOIN_TIMEOUT_S):
            log.warning("worker %d: not every peer heard within %ss", index, BUS_JOIN_TIMEOUT_S)
        ready.send(os.getpid())
        ready.close()
        await stop.wait()
    finally:
        log.info("worker %d draining (up to %ss)", index, config.drain_timeout_s)
        await listeners.runner.cleanup()


# ---------------------------------------------------------------- supervisor side


@dataclass(slots=True)
class _Slot:
    """One worker position: the process now filling it and its restart bookkeeping."""

    index: int  # 0..N-1, stable across restarts
    process: BaseProcess | None = None  # None while waiting to be restarted
    ready_conn: Connection | None = None  # read end of the worker's ready pipe
    pid: int | None = None  # set once the worker said it listens
    started_at: float = 0.0  # monotonic seconds of the last start
    restart_at: float | None = None  # when to start it again (None: not scheduled)
    backoff_s: float = 0.0  # delay of the next restart
    num_restarts: int = 0


class Supervisor:
    """Starts N workers, restarts the ones that die, drains them all on a signal.

    Invariant: outside ``_reap``, a slot either has a live-or-unreaped process or a
    scheduled ``restart_at`` (while not stopping).
    """

    def __init__(self, config: RouterConfig, sup: SupervisorConfig) -> None:
        self.config = config
        self.sup = sup
        self.slots = [_Slot(i, backoff_s=sup.backoff_initial_s) for i in range(sup.num_workers)]
        self.stopping = False
        self._ctx = multiprocessing.get_context("spawn")
        self._bus_dir: str | None = None  # ipc sockets of the decision bus

    def request_stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        """Signal handler: begin a graceful shutdown (workers are told in ``run``)."""
        self.stopping = True

    def run(self) -> int:
        """Serve until a signal; 0 when every worker drained and exited cleanly."""
        build_fleet(self.config.policy)  # an unknown policy fails here, not N times below
        with naming_flags(self.config.host, self.config.port, ("--host", "--port")):
            reserved = reserve_port(self.config.host, self.config.port)
        port = reserved.getsockname()[1]
        self.config = replace(self.config, port=port)
        admin_reserved: socket.socket | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request_stop)
        if self.sup.share_decisions and len(self.slots) > 1:
            sweep_stale_bus_dirs(tempfile.gettempdir())
            self._bus_dir = tempfile.mkdtemp(prefix=f"{BUS_DIR_PREFIX}{os.getpid()}-")
        try:
            admin_reserved, admin = self._reserve_admin_port()
            for slot in self.slots:
                self._start(slot)
            if not self._wait_all_ready():
                stopped_by_signal = self.stopping
                self.stopping = True
                code = self._shutdown()
                return code if stopped_by_signal else max(1, code)
            print(
                f"kvroute serve: listening on http://{self.config.host}:{port} "
                f"({len(self.config.backends)} backends, policy {self.config.policy}{admin}, "
                f"{len(self.slots)} workers: pids {' '.join(str(s.pid) for s in self.slots)})",
                flush=True,
            )
            while not self.stopping:
                self._tick(timeout_s=0.2)
            return self._shutdown()
        finally:
            reserved.close()
            if admin_reserved is not None:
                admin_reserved.close()
            if self._bus_dir is not None:
                shutil.rmtree(self._bus_dir, ignore_errors=True)

    def _reserve_admin_port(self) -> tuple[socket.socket | None, str]:
        """Fix the admin listener's port like the main one (0 -> one free port for every
        worker); the socket to close at the end and the text for the "listening" line."""
        server = self.config.server
        if server.admin_port is None:
            return None, ""
        host = server.admin_host or self.config.host
        with naming_flags(host, server.admin_port, ("--admin-host", "--admin-port")):
            sock = reserve_port(host, server.admin_port)
        admin_port = sock.getsockname()[1]
        self.config = replace(self.config, server=replace(server, admin_port=admin_port))
        return sock, f"; admin on http://{host}:{admin_port}"

    def _start(self, slot: _Slot) -> None:
        read_end, write_end = self._ctx.Pipe(duplex=False)
        base = self.sup.private_port_base
        private_port = None if base is None else base + slot.index
        bus = None
        if self._bus_dir is not None:
            bus = BusSpec(self._bus_dir, slot.index, len(self.slots))
        args = (self.config, slot.index, private_port, bus, self.sup.log_level, write_end)
        proc = self._ctx.Process(
            target=worker_main, args=args, name=f"kvroute-worker-{slot.index}", daemon=True
        )
        proc.start()
        write_end.close()  # the child holds the only write end: EOF when it dies
        slot.process, slot.ready_conn, slot.pid = proc, read_end, None
        slot.started_at, slot.restart_at = time.monotonic(), None

    def _wait_all_ready(self) -> bool:
        """Wait for the first start of every worker; False if one died or timed out."""
        deadline = time.monotonic() + self.sup.start_timeout_s
        while not self.stopping and time.monotonic() < deadline:
            self._poll_ready(timeout_s=0.2)
            if any(s.process is not None and not s.process.is_alive() for s in self.slots):
                print("kvroute serve: a worker failed to start", file=sys.stderr)
                return False
            if all(s.pid is not None for s in self.slots):
                return True
        return False

    def _poll_ready(self, timeout_s: float) -> None:
        conns = [s.ready_conn for s in self.slots if s.ready_conn is not None]
        sentinels = [s.process.sentinel for s in self.slots if s.process is not None]
        ready = set(wait([*conns, *sentinels], timeout=timeout_s)) if conns or sentinels else ()
        for slot in self.slots:
            conn = slot.ready_conn
            if conn is None or conn not in ready:
                continue
            with contextlib.suppress(EOFError, OSError):  # died first: the reaper restarts it
                slot.pid = conn.recv()
            conn.close()
            slot.ready_conn = None

    def _tick(self, timeout_s: float) -> None:
        """One supervision round: note ready workers, reap dead ones, start due restarts."""
        self._poll_ready(timeout_s)
        now = time.monotonic()
        for slot in self.slots:
            self._reap(slot, now)
            if slot.restart_at is not None and now >= slot.restart_at and not self.stopping:
                slot.num_restarts += 1
                self._start(slot)

    def _reap(self, slot: _Slot, now: float) -> None:
        proc = slot.process
        if proc is None or proc.is_alive():
            return
        proc.join()
        ran_s = now - slot.started_at
        if ran_s >= self.sup.stable_after_s:
            slot.backoff_s = self.sup.backoff_initial_s
        log.warning(
            "worker %d (pid %s) exited with %s after %.1f s; restarting in %.1f s",
            slot.index, proc.pid, proc.exitcode, ran_s, slot.backoff_s,
        )  # fmt: skip
        if slot.ready_conn is not None:
            slot.ready_conn.close()
        slot.process, slot.ready_conn, slot.pid = None, None, None
        slot.restart_at = now + slot.backoff_s
        slot.backoff_s = min(2 * slot.backoff_s, self.sup.backoff_max_s)

    def _shutdown(self) -> int:
        """SIGTERM every worker, wait for the drain, kill stragglers; the exit code."""
        live = [s.process for s in self.slots if s.process is not None]
        for proc in live:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_timeout_s + self.sup.kill_grace_s
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
        code = 0
        for proc in live:
            if proc.is_alive():
                log.warning("worker pid %s did not drain in time; killing it", proc.pid)
                proc.kill()
                proc.join()
                code = 1
            elif proc.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT):
                code = 1
        for slot in self.slots:
            if slot.ready_conn is not None:
                slot.ready_conn.close()
        return code


def run_workers(config: RouterConfig, sup: SupervisorConfig) -> int:
    """``kvroute serve --workers N`` (N >= 2): supervise N router processes."""
    return Supervisor(config, sup).run()
