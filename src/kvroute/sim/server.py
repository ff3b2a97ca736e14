"""Simulated vLLM backends on ports, and fleets of them.

A ``SimBackend`` is an ``EngineLoop`` (sim/engine_loop.py) served by the aiohttp app of
sim/api.py on ``host:port``; the app's startup and cleanup start and stop the loop.
``start_fleet`` starts N of them (with KV event and replay endpoints when asked) and
returns a ``SimFleet`` handle. The imports go one way: engine_loop <- api <- server.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from aiohttp import web

from kvroute.engine.profiles import EngineProfile
from kvroute.sim.api import make_sim_app
from kvroute.sim.engine_loop import EngineLoop
from kvroute.sim.faults import Faults


class SimBackend(EngineLoop):
    """One simulated vLLM server: an engine loop and its HTTP app on ``host:port``."""

    def __init__(
        self,
        profile: EngineProfile | str,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        speedup: float = 1.0,
        kv_events_endpoint: str | None = None,
        kv_replay_endpoint: str | None = None,
        faults: Faults | None = None,
        model_name: str | None = None,
        seed: int = 0,
        jitter: float = 0.0,
    ) -> None:
        super().__init__(
            profile,
            speedup=speedup,
            kv_events_endpoint=kv_events_endpoint,
            kv_replay_endpoint=kv_replay_endpoint,
            faults=faults,
            model_name=model_name,
            seed=seed,
            jitter=jitter,
        )
        self.host = host
        self.port = port  # the bound port once started
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def task_name(self) -> str:
        return f"sim-engine-{self.port}"

    async def start(self) -> None:
        """Serve HTTP on ``host:port`` (port 0: a free one, stored in ``self.port``)."""
        self._runner = web.AppRunner(make_sim_app(self), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        try:
            await site.start()
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            error = OSError(f"cannot serve HTTP on {self.host}:{self.port}: {reason or exc}")
            error.errno = exc.errno
            raise error from exc
        server = site._server
        assert server is not None and server.sockets, "a started site has a socket"
        self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # runs the app's cleanup: stop_engine
            self._runner = None
        await self.stop_engine()


@dataclass
class SimFleet:
    """Handle on N backends started by ``start_fleet``."""

    backends: list[SimBackend] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.backends]

    @property
    def kv_endpoints(self) -> list[str | None]:
        return [b.kv_endpoint for b in self.backends]

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends), return_exceptions=True)


async def start_fleet(
    n: int,
    port_base: int = 0,
    profile: EngineProfile | str = "tiny",
    speedup: float = 1.0,
    kv_events: bool = False,
    *,
    host: str = "127.0.0.1",
    kv_port_base: int = 0,
    kv_replay: bool = False,
    kv_replay_port_base: int = 0,
    model_name: str | None = None,
    faults: dict[int, Faults] | None = None,
    seed: int = 0,
    jitter: float = 0.0,
) -> SimFleet:
    """Start ``n`` backends on ports ``port_base..port_base+n-1`` (0: free ports).

    With ``kv_events`` each backend publishes on ``tcp://host:kv_port_base+i``
    (``kv_port_base`` 0: free ports); ``fleet.kv_endpoints`` has the bound endpoints.
    With ``kv_replay`` each also serves replays on ``kv_replay_port_base+i`` (0: free
    ports), so a restarted backend can keep the endpoints a router was given.
    """
    if n < 1:
        raise ValueError(f"a fleet needs at least one backend, got {n}")
    fleet = SimFleet()
    try:
        for i in range(n):
            kv = None
            replay = None
            if kv_events:
                kv = f"tcp://{host}:{kv_port_base + i if kv_port_base else 0}"
                replay_port = kv_replay_port_base + i if kv_replay_port_base else 0
                replay = f"tcp://{host}:{replay_port}" if kv_replay else None
            backend = SimBackend(
                profile,
                port=port_base + i if port_base else 0,
                host=host,
                speedup=speedup,
                kv_events_endpoint=kv,
                kv_replay_endpoint=replay,
                faults=(faults or {}).get(i),
                model_name=model_name,
                seed=seed + i,
                jitter=jitter,
            )
            fleet.backends.append(backend)
            await backend.start()
    except BaseException:
        await fleet.close()
        raise
    return fleet
