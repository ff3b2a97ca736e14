"""The processes of the soak and chaos harnesses: restartable simulators and a router.

Each simulated backend is its own ``kvroute sim --backends 1`` process on fixed ports
(HTTP, KV events, replay), so it can be killed and started again where the router
expects it. The router is a real ``kvroute serve`` process with a YAML config written
next to the logs. Both are ``ManagedProcess`` (bench/procs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvroute.bench.procs import KVROUTE, ManagedProcess, free_port, free_port_range


class SimProcess:
    """One simulated backend in its own process, restartable on the same ports."""

    def __init__(
        self,
        index: int,
        ports: tuple[int, int, int],
        logs: Path,
        *,
        profile: str = "tiny",
        speedup: float = 1.0,
        kv_events: bool = True,
    ) -> None:
        self.index = index
        self.http_port, self.kv_port, self.replay_port = ports
        self.kv_events = kv_events
        self.num_starts = 0
        self._logs = logs
        cmd = [*KVROUTE, "sim", "--backends", "1"]
        cmd += ["--port-base", str(self.http_port), "--profile", profile]
        cmd += ["--speedup", str(speedup), "--seed", str(index)]
        if kv_events:
            cmd += ["--kv-events", "--kv-port-base", str(self.kv_port), "--kv-replay"]
            cmd += ["--kv-replay-port-base", str(self.replay_port)]
        self.cmd = cmd
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def kv_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.kv_port}" if self.kv_events else None

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.kv_events else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start (again) and wait for /health; each start logs to its own file."""
        self.num_starts += 1
        log = self._logs / f"sim{self.index}.{self.num_starts}.log"
        self._proc = ManagedProcess(f"sim{self.index}", self.cmd, log)
        await self._proc.start()
        await self._proc.wait_ready([f"{self.url}/health"], timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash: no drain, streams cut, the KV publisher gone."""
        if self._proc is not None and self.alive:
            self._proc.kill()

    async def stop(self) -> None:
        if self._proc is not None:
            await self._proc.stop()


def sim_fleet(
    n: int, logs: Path, *, profile: str = "tiny", speedup: float = 1.0, kv_events: bool = True
) -> list[SimProcess]:
    """``n`` simulators on three free port ranges (HTTP, KV events, replay)."""
    base = free_port_range(3 * n)
    return [
        SimProcess(
            i,
            (base + i, base + n + i, base + 2 * n + i),
            logs,
            profile=profile,
            speedup=speedup,
            kv_events=kv_events,
        )
        for i in range(n)
    ]


def router_config(
    sims: Sequence[SimProcess], *, mode: str, port: int, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The router's YAML document: the sims (with their KV endpoints in exact/auto mode)
    plus ``overrides`` (sections merged one level deep)."""
    backends: list[dict[str, Any]] = []
    for s in sims:
        b: dict[str, Any] = {"url": s.url}
        if mode != "approximate" and s.kv_endpoint is not None:
            b |= {"kv_events": s.kv_endpoint, "kv_replay": s.replay_endpoint}
        backends.append(b)
    doc: dict[str, Any] = {"backends": backends, "mode": mode, "port": port, "policy": "prefix"}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(doc.get(key), Mapping):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


class RouterProcess:
    """``kvroute serve --config FILE`` on a free port."""

    def __init__(self, doc: dict[str, Any], logs: Path) -> None:
        self.port = int(doc["port"]) or free_port()
        doc = {**doc, "port": self.port}
        self.config_path = logs / "router.yaml"
        logs.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        cmd = [*KVROUTE, "serve", "--config", str(self.config_path)]
        self._proc = ManagedProcess("router", cmd, logs / "router.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def start(self, timeout_s: float = 30.0) -> None:
        await self._proc.start()
        await self._proc.wait_ready([f"{self.url}/health"], timeout_s)

    def tail(self, num_lines: int = 20) -> str:
        return self._proc.tail(num_lines)

    async def stop(self) -> None:
        await self._proc.stop()


@contextlib.asynccontextmanager
async def sims_and_router(
    sims: Sequence[SimProcess], *, mode: str, overrides: Mapping[str, Any], logs: Path
) -> AsyncIterator[RouterProcess]:
    """Start every sim, then the router in front of them; stop all on the way out."""
    router = RouterProcess(router_config(sims, mode=mode, port=0, overrides=overrides), logs)
    try:
        await asyncio.gather(*(s.start() for s in sims))
        await router.start()
        yield router
    finally:
        await asyncio.shield(_stop_all([router, *sims]))


async def _stop_all(procs: Sequence[RouterProcess | SimProcess]) -> None:
    for proc in procs:
        await proc.stop()
