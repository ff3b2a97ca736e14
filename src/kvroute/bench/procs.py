"""Child processes of the benchmarks: simulated fleets, routers, peers, bare backends.

Each runs as its own OS process, as in production, so the load generator, the router
and the engines do not share one event loop (a router in the load generator's loop
would be measured against itself). Peers (sglang-router, vllm-router) are started
through their own command lines with their own defaults.

``ManagedProcess`` is the one way the harness starts a child: in a session of its own
(so stopping its process group stops its workers too), output to a log file, stopped
by SIGTERM then SIGKILL, and killed at exit if the harness dies first. It has async
methods for the asyncio harnesses and ``*_sync`` twins for the synchronous scripts.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

KVROUTE_POLICIES = ("round_robin", "random", "least_load", "power_of_two", "consistent_hash")
# kvroute policies that model another router (core/policy/): for the simulator above all
PEER_MODELS = (
    "sglang-cache-aware",
    "dynamo",
    "aibrix-dualmap",
    "llm-d",
    "llm-d-no-hit-lru",
    "chwbl",
)
PEERS = ("sglang", "vllm-router")
KVROUTE = (sys.executable, "-m", "kvroute.cli")  # the kvroute command of this Python


class RouterUnavailable(RuntimeError):
    """A router named in ``--routers`` that is not installed here (reported as skipped)."""


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One entry of ``--routers``: which program runs and with which policy."""

    name: str  # as the user wrote it, the label in reports
    kind: str  # "kvroute" or a peer name
    policy: str  # kvroute policy name, or the peer's policy
    mode: str | None = None  # kvroute's --mode; "exact" also makes the fleet publish KV events
    policy_args: tuple[str, ...] = ()  # kvroute's --policy-arg KEY=VALUE, each


def parse_router(name: str) -> RouterSpec:
    """``round_robin`` | ``kvroute`` | ``kvroute-exact`` | ``kvroute:<policy>`` | peers.

    A model of a peer (``PEER_MODELS``) runs in approximate mode; ``<model>-exact``
    (``dynamo-exact``) runs it in exact mode, on the engines' KV events.

    ``kvroute:<policy>:KEY=VALUE:...`` gives the policy parameters (``--policy-arg``),
    checked here: ``kvroute:prefix:max_holders=8:num_hashed=0``.
    """
    if name == "kvroute":
        return RouterSpec(name, "kvroute", "prefix")
    if name == "kvroute-exact":
        return RouterSpec(name, "kvroute", "prefix", mode="exact")
    if name.startswith("kvroute:"):
        policy, *args = name.split(":")[1:]
        _check_policy_args(policy, args)
        return RouterSpec(name, "kvroute", policy, policy_args=tuple(args))
    if name in KVROUTE_POLICIES or name in PEER_MODELS:
        return RouterSpec(name, "kvroute", name)
    if name.removesuffix("-exact") in PEER_MODELS:  # a peer model on KV events (exact mode)
        return RouterSpec(name, "kvroute", name.removesuffix("-exact"), mode="exact")
    if name in PEERS:
        return RouterSpec(name, name, "cache_aware")
    kvroute = ("kvroute", "kvroute-exact", "kvroute:<policy>")
    known = ", ".join((*KVROUTE_POLICIES, *kvroute, *PEER_MODELS, "<peer model>-exact", *PEERS))
    raise ValueError(f"unknown router {name!r}; known: {known}")


def _check_policy_args(policy: str, args: Sequence[str]) -> None:
    """ValueError naming the key for an unknown policy or a bad KEY=VALUE of its own."""
    from kvroute.core.params import parse_text
    from kvroute.core.policy import policy_class

    params = policy_class(policy).Params
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"kvroute:{policy}: expected KEY=VALUE, got {arg!r}")
        parse_text(params, key, value, f"policies.{policy}")


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(n: int, start: int = 21000, stop: int = 60000) -> int:
    """A base port P with P..P+n-1 all free on loopback, outside the kernel's ephemeral
    range where [start, stop) leaves room: ports chosen now are bound later (and bound
    again after a restart), and any outgoing connection may take an ephemeral port in
    between (a chaos run once lost a simulator to that: "Address already in use")."""
    start, stop = _outside_ephemeral(start, stop, n)
    base = start + (os.getpid() * 97) % (stop - start - n)
    for _ in range(200):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            base = start + (base + n * 7 + 13 - start) % (stop - start - n)
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no range of {n} free ports found")


def _outside_ephemeral(start: int, stop: int, n: int) -> tuple[int, int]:
    """The widest part of [start, stop) outside ``ip_local_port_range`` with room for
    more than ``n`` ports, else [start, stop) itself."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(x) for x in text.split())
    except (OSError, ValueError):
        return start, stop  # not Linux, or unreadable: any port may be ephemeral
    parts = [(start, min(stop, low)), (max(start, high + 1), stop)]
    part = max(parts, key=lambda p: p[1] - p[0])
    return part if part[1] - part[0] > n else (start, stop)


NO_BACKENDS = "the simulated fleet's are used, remove them"


def check_router_config(path: str, specs: Sequence[RouterSpec] = ()) -> None:
    """A kvroute YAML for a simulated fleet: it must load (ValueError saying what is
    wrong), list no backends, since the fleet's are added to it, and set no policy or
    mode that one of the kvroute routers ``specs`` would override."""
    from kvroute.router.config import load_config, read_yaml  # only when used

    try:
        config = load_config(path)
        raw = read_yaml(path)
    except OSError as exc:
        raise ValueError(f"router config {path}: {exc.strerror or exc}") from None
    if config.backends:
        raise ValueError(f"router config {path} lists backends: {NO_BACKENDS}")
    for spec in specs:
        if spec.kind == "kvroute":
            check_router_owns(raw, spec, path)


def check_router_owns(raw: Mapping[str, Any], spec: RouterSpec, path: str) -> None:
    """The router's name sets its policy and mode: a file saying otherwise would be
    silently overridden, so it is refused."""
    for key, value in (("policy", spec.policy), ("mode", spec.mode)):
        given = raw.get(key)
        if value is not None and given is not None and given != value:
            raise ValueError(
                f"router config {path} sets {key}: {given}, but the router {spec.name} "
                f"runs {key} {value}: remove {key} from the file, or name the router for it "
                "(kvroute:POLICY, kvroute-exact)"
            )


def router_command(
    spec: RouterSpec,
    backends: Sequence[str],
    port: int,
    kv_endpoints: Sequence[str] = (),
    config_path: str | None = None,
) -> list[str]:
    """The command line that starts ``spec`` on ``port`` in front of ``backends``.

    ``kv_endpoints``: the backends' KV-event endpoints (same order), for exact mode;
    ``config_path``: a YAML file for kvroute (the peers take none).
    """
    if spec.kind == "kvroute":
        cmd = [*KVROUTE, "serve", "--policy", spec.policy]
        if config_path is not None:
            cmd += ["--config", str(config_path)]
        for url in backends:
            cmd += ["--backend", url]
        if spec.mode is not None:
            cmd += ["--mode", spec.mode]
        for arg in spec.policy_args:
            cmd += ["--policy-arg", arg]
        for url, endpoint in zip(backends, kv_endpoints, strict=False):
            cmd += ["--kv-events", f"{url}={endpoint}"]
        return [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    prom = ["--prometheus-port", str(free_port())]  # both peers default to 29000: collide
    common = ["--worker-urls", *backends, "--policy", spec.policy]
    common += ["--host", "127.0.0.1", "--port", str(port), *prom]
    if spec.kind == "sglang":
        if importlib.util.find_spec("sglang_router") is None:
            raise RouterUnavailable("sglang-router is not installed (pip install '.[peers]')")
        return [sys.executable, "-m", "sglang_router.launch_router", *common]
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(exe).exists():
        raise RouterUnavailable("vllm-router is not installed (pip install '.[peers]')")
    return [exe, *common]


def sim_command(
    num_backends: int, port_base: int, profile: str, speedup: float, extra: Sequence[str] = ()
) -> list[str]:
    """``kvroute sim`` with N backends on ports ``port_base``.. (0: the OS picks)."""
    cmd = [*KVROUTE, "sim", "--backends", str(num_backends)]
    cmd += ["--port-base", str(port_base), "--profile", profile, "--speedup", str(speedup)]
    return [*cmd, *extra]


SIM_LINE = r"^backend \d+: "  # what ``kvroute sim`` prints once per engine when it is up
_SIM_LINE = re.compile(r"^backend (\d+): (\S+)(?:\s+kv-events (\S+))?(?:\s+replay (\S+))?")


@dataclass(frozen=True, slots=True)
class SimEngine:
    """One simulated engine as ``kvroute sim`` printed it."""

    url: str  # HTTP base URL
    kv_events: str | None  # its KV-event PUB endpoint (--kv-events)
    kv_replay: str | None  # its replay ROUTER endpoint (--kv-replay)


def sim_engines(lines: Sequence[str]) -> list[SimEngine]:
    """The engines of ``kvroute sim``'s ``backend N: ...`` lines, in index order."""
    found = {int(m[1]): SimEngine(m[2], m[3], m[4]) for x in lines if (m := _SIM_LINE.match(x))}
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"backend lines out of order or missing: {sorted(found)}")
    return [found[i] for i in range(len(found))]


# ---- one child process ---------------------------------------------------------------

_LIVE: set[ManagedProcess] = set()  # started and not yet stopped


@atexit.register
def _kill_survivors() -> None:
    """SIGKILL the process group of every child still running when the harness exits."""
    for proc in list(_LIVE):
        proc.kill()


def exit_on_sigterm() -> None:
    """SIGTERM (a CI job's timeout, ``kill``) ends the harness as Ctrl-C does, so its
    ``finally`` blocks and the atexit hook stop the children it started (the default
    action would leave them running)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ManagedProcess:
    """A child process in its own session, with its output in a log file."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name  # label in errors and reports
        self.cmd = list(cmd)
        self.log_path = log_path
        self._env = None if env is None else dict(env)
        self._cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        """Start the child (it runs on; ``stop`` or ``stop_sync`` ends it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self._popen = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                cwd=self._cwd,
                start_new_session=True,
            )
        _LIVE.add(self)

    async def start(self) -> None:
        self.launch()

    @property
    def pid(self) -> int | None:
        """The child's pid (also its process group id), once started."""
        return None if self._popen is None else self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs (or before it starts)."""
        return None if self._popen is None else self._popen.poll()

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def _check(self, what: str, deadline: float, timeout_s: float) -> None:
        """Raise when the child died or the time for ``what`` is up."""
        if self._popen is not None and self._popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.returncode}):\n{self.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{self.name}: no {what} in {timeout_s:.0f} s:\n{self.tail()}")

    async def wait_ready(self, urls: Sequence[str], timeout_s: float) -> None:
        """Wait until every ``url`` answers 200, or fail with the log's tail."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while pending:
                self._check(f"answer from {pending[0]}", deadline, timeout_s)
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(pending[0]) as resp:
                        if resp.status == 200:
                            pending.pop(0)
                            continue
                await asyncio.sleep(0.2)

    def wait_ready_sync(self, urls: Sequence[str], timeout_s: float) -> None:
        """``wait_ready`` for synchronous callers."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            self._check(f"answer from {pending[0]}", deadline, timeout_s)
            if http_ok(pending[0]):
                pending.pop(0)
            else:
                time.sleep(0.2)

    async def wait_line(self, pattern: str, timeout_s: float, count: int = 1) -> list[str]:
        """The first ``count`` log lines matching ``pattern``, once there are that many."""
        deadline = time.monotonic() + timeout_s
        while len(found := self._lines(pattern)) < count:
            self._check(f"line matching {pattern!r}", deadline, timeout_s)
            await asyncio.sleep(0.1)
        return found[:count]

    def wait_line_sync(self, pattern: str, timeout_s: float, count: int = 1) -> list[str]:
        """``wait_line`` for synchronous callers."""
        deadline = time.monotonic() + timeout_s
        while len(found := self._lines(pattern)) < count:
            self._check(f"line matching {pattern!r}", deadline, timeout_s)
            time.sleep(0.1)
        return found[:count]

    def _lines(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        return [line for line in self.log_text().splitlines() if regex.search(line)]

    def send_signal(self, sig: signal.Signals) -> None:
        """Signal the child alone (not its group), as an init system would."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(sig)

    def wait_sync(self, timeout_s: float) -> int:
        """The child's exit code once it exits; TimeoutError after ``timeout_s``."""
        assert self._popen is not None, "wait after launch"
        try:
            return self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{self.name} still running after {timeout_s} s") from exc

    def kill(self) -> None:
        """SIGKILL the process group at once, as a crash."""
        if self._popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self._popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, sig)

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group; SIGKILL it if the child outlives ``grace_s``."""
        popen = self._popen
        if popen is not None:
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while popen.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.kill()  # the leader is gone (or late): its workers go too
            await asyncio.to_thread(popen.wait)
        _LIVE.discard(self)

    def stop_sync(self, grace_s: float = 5.0) -> None:
        """``stop`` for synchronous callers."""
        popen = self._popen
        if popen is not None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(grace_s)
            self.kill()
            popen.wait()
        _LIVE.discard(self)


def one_line(text: str) -> str:
    """A message as one console line: its first line, and its last when it goes on (a
    ManagedProcess failure ends with the tail of the child's log, whose last line is the
    child's own error: ``sim exited (2): ... kvroute sim: unknown engine profile``)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    return lines[0] if lines else ""


def error_line(exc: BaseException) -> str:
    """``one_line`` of ``Type: message``."""
    return one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 now (synchronous)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` so far (and of its direct children), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    paths = Path("/proc").glob("[0-9]*/stat") if children else [Path(f"/proc/{pid}/stat")]
    for stat in paths:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat.parent.name) == pid or (children and int(fields[1]) == pid):
            total += (int(fields[11]) + int(fields[12])) / tick
    return total
