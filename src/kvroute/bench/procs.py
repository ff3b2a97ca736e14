"""Processes a comparison runs: a simulated fleet and one router in front of it.

Each runs as its own OS process, as in production, so the load generator, the router
and the engines do not share one event loop (a router in the load generator's loop
would be measured against itself). Peers (sglang-router, vllm-router) are started
through their own command lines with their own defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

KVROUTE_POLICIES = ("round_robin", "random", "least_load", "power_of_two", "consistent_hash")
PEERS = ("sglang", "vllm-router")


class RouterUnavailable(RuntimeError):
    """A router named in ``--routers`` that is not installed here (reported as skipped)."""


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One entry of ``--routers``: which program runs and with which policy."""

    name: str  # as the user wrote it, the label in reports
    kind: str  # "kvroute" or a peer name
    policy: str  # kvroute policy name, or the peer's policy
    mode: str | None = None  # kvroute's --mode; "exact" also makes the fleet publish KV events


def parse_router(name: str) -> RouterSpec:
    """``round_robin`` | ``kvroute`` | ``kvroute-exact`` | ``kvroute:<policy>`` | peers."""
    if name == "kvroute":
        return RouterSpec(name, "kvroute", "prefix")
    if name == "kvroute-exact":
        return RouterSpec(name, "kvroute", "prefix", mode="exact")
    if name.startswith("kvroute:"):
        return RouterSpec(name, "kvroute", name.split(":", 1)[1])
    if name in KVROUTE_POLICIES:
        return RouterSpec(name, "kvroute", name)
    if name in PEERS:
        return RouterSpec(name, name, "cache_aware")
    known = ", ".join((*KVROUTE_POLICIES, "kvroute", "kvroute-exact", "kvroute:<policy>", *PEERS))
    raise ValueError(f"unknown router {name!r}; known: {known}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(n: int, start: int = 21000, stop: int = 60000) -> int:
    """A base port P with P..P+n-1 all free on loopback."""
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


def router_command(
    spec: RouterSpec, backends: Sequence[str], port: int, kv_endpoints: Sequence[str] = ()
) -> list[str]:
    """The command line that starts ``spec`` on ``port`` in front of ``backends``.

    ``kv_endpoints``: the backends' KV-event endpoints (same order), for exact mode.
    """
    if spec.kind == "kvroute":
        cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--policy", spec.policy]
        for url in backends:
            cmd += ["--backend", url]
        if spec.mode is not None:
            cmd += ["--mode", spec.mode]
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


class ManagedProcess:
    """A child process with its output in a log file, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], log_path: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._log = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self._proc = await asyncio.create_subprocess_exec(
            *self.cmd,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int | None:
        """The child's pid (also its process group id), once started."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def wait_ready(self, urls: Sequence[str], timeout_s: float) -> None:
        """Wait until every ``url`` answers 200, or fail with the log's tail."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while pending:
                if self.returncode is not None:
                    raise RuntimeError(f"{self.name} exited ({self.returncode}):\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} not ready in {timeout_s:.0f} s:\n{self.tail()}"
                    )
                url = pending[0]
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            pending.pop(0)
                            continue
                await asyncio.sleep(0.2)

    def tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    async def stop(self, grace_s: float = 5.0) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def sim_command(
    num_backends: int, port_base: int, profile: str, speedup: float, extra: Sequence[str] = ()
) -> list[str]:
    cmd = [sys.executable, "-m", "kvroute.cli", "sim", "--backends", str(num_backends)]
    cmd += ["--port-base", str(port_base), "--profile", profile, "--speedup", str(speedup)]
    return [*cmd, *extra]
