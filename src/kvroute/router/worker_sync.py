"""Fleet replication between the workers of one ``kvroute serve --workers N``.

Why: each worker has its own ``Fleet`` (index, load, learned rates), fed only by the
requests it handles. The rendezvous tie-break makes workers agree on a new prefix only
while their views tie; under load each sees only its own in-flight requests and its own
cache model, so they place the same prefix on different backends and the fleet caches it
several times (measured on ranvier-stress with little KV headroom: engine hit rate
99.5 % with 1 worker, 63.5-63.9 % with 4 unsynchronised workers, docs/deploy.md). So
every worker hears the Fleet changes made for its own requests (a ``FleetListener``:
dispatch, first token, engine-reported hit, finish), publishes them, and replays its
peers' on its own Fleet with a shadow ticket. Every worker then holds the view one
process handling all the host's requests would hold: the same holders, the same load,
and nearly the same learned rates.

How: one ZMQ PUB socket per worker, bound to ``ipc://DIR/w<index>``, and one SUB socket
connected to every other worker (ZMQ reconnects to a restarted peer by itself). Messages
are msgpack arrays tagged by kind (see ``_KIND_*``), sent as one frame per event-loop
iteration (a list of messages: cheaper under load); ``now`` travels with them, which is
sound because every worker's clock is the host's ``time.monotonic``. Delivery is
best-effort: a dispatch message lost (a peer still connecting) only costs a possible
miss; a finish message lost would leave load counted, so every worker sends a heartbeat
each ``heartbeat_s``, and the shadows of a peer that went silent for ``peer_timeout_s``,
or came back with a new pid, are finished at once.

Joining: a PUB socket drops what it sends before a peer's SUB has connected, and a SUB
connecting to a peer that has not bound yet retries only every 100 ms, so right after
startup placements were lost for up to a second (seen as duplicate placements in
tests). A worker counts as connected once it has heard every peer; until it and all its
peers are connected it sends heartbeats each ``join_heartbeat_s``, each saying whether
it is connected, and ``wait_connected`` lets a worker report ready only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.core.fleet import Fleet
from kvroute.core.load import Ticket
from kvroute.core.policy.base import Decision, RouteRequest
from kvroute.router.state import STATE

log = logging.getLogger("kvroute.router.worker_sync")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

# message kinds: [kind, origin index, origin pid, ...]
# ticket_id, url, reason, request_id, model, hashes, prompt, max_tokens, now, session
_KIND_DISPATCH = 0
_KIND_FIRST_TOKEN = 1  # ticket_id, now, cached_tokens | None
_KIND_CACHED = 2  # ticket_id, cached_tokens
_KIND_FINISH = 3  # ticket_id, now, ok
_KIND_HEARTBEAT = 4  # connected (this worker has heard every peer)


@dataclass(frozen=True, slots=True)
class BusSpec:
    """Where the workers of one supervisor meet."""

    directory: str  # a private folder holding one ipc socket file per worker
    index: int  # this worker, 0..num_workers-1
    num_workers: int  # all workers, this one included
    heartbeat_s: float = 1.0  # a worker says it is alive this often
    join_heartbeat_s: float = 0.02  # ... and this often until every worker is connected
    peer_timeout_s: float = 5.0  # a peer silent this long is dead: its shadows finish

    def endpoint(self, index: int) -> str:
        return f"ipc://{self.directory}/w{index}"


@dataclass(slots=True)
class _Peer:
    """What this worker knows of one other worker."""

    pid: int  # the process now filling that index
    last_heard_s: float  # monotonic seconds of its last message
    shadows: dict[int, Ticket]  # its ticket id -> our shadow ticket of that request
    connected: bool = False  # its last heartbeat said it has heard every worker


class FleetBus:
    """Publishes this worker's Fleet changes (as a FleetListener); replays its peers' on
    the Fleet with shadow tickets.

    Invariant: every unfinished shadow ticket belongs to a peer in ``peers``; a peer's
    shadows are finished when it finishes them, dies (silent) or restarts (new pid).
    """

    def __init__(self, spec: BusSpec, fleet: Fleet, context: zmq.asyncio.Context) -> None:
        self.spec = spec
        self.fleet = fleet
        self.pid = os.getpid()
        self.peers: dict[int, _Peer] = {}
        self.num_sent = 0
        self.num_applied = 0
        self._outbox: list[tuple[Any, ...]] = []  # messages waiting for _flush
        self._replaying = False  # applying peers' calls: the Fleet's notices are not ours
        self._connected = asyncio.Event()  # set while every peer is heard
        # sends never wait (NOBLOCK): a plain socket skips the asyncio wrapper's futures
        self.pub = zmq.Context.shadow(context.underlying).socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(spec.endpoint(spec.index))
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for peer in range(spec.num_workers):
            if peer != spec.index:
                self.sub.connect(spec.endpoint(peer))
        # the same socket without the asyncio wrapper: drains a backlog without a future
        # per frame once the awaited receive woke up
        self._sub_now = zmq.Socket.shadow(self.sub.underlying)

    # -- this worker's calls (FleetListener): tell the peers -----------------------------

    def install(self) -> None:
        """Start mirroring: hear every request-path change the Fleet makes."""
        self.fleet.listeners.append(self)

    def on_dispatch(
        self, ticket: Ticket, decision: Decision, req: RouteRequest, now: float
    ) -> None:
        if not self._replaying:
            self._send(_KIND_DISPATCH, ticket.ticket_id, ticket.url, decision.reason,
                       req.request_id, req.model, list(req.block_hashes),
                       req.num_prompt_tokens, req.max_tokens, now, req.session,
                       req.cacheable)  # fmt: skip

    def on_first_token(self, ticket: Ticket, now: float, cached_tokens: int | None) -> None:
        if not self._replaying:
            self._send(_KIND_FIRST_TOKEN, ticket.ticket_id, now, cached_tokens)

    def on_cached_tokens(self, ticket: Ticket, cached_tokens: int) -> None:
        if not self._replaying:
            self._send(_KIND_CACHED, ticket.ticket_id, int(cached_tokens))

    def on_finish(self, ticket: Ticket, now: float, ok: bool) -> None:
        if not self._replaying:
            self._send(_KIND_FINISH, ticket.ticket_id, now, bool(ok))

    def _send(self, kind: int, *fields: Any) -> None:
        """Queue one message; the messages of one loop iteration leave as one frame."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((kind, self.spec.index, self.pid, *fields))

    def _flush(self) -> None:
        """Publish the queued messages; never blocks (a full queue drops the frame)."""
        batch, self._outbox = self._outbox, []
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.pub.send(_encode(batch), zmq.NOBLOCK)
            self.num_sent += len(batch)

    # -- the peers' calls: replay them with shadow tickets -----------------------------

    def apply(self, payload: bytes, now_s: float) -> None:
        """Replay one frame of peer messages on our Fleet (bad ones are dropped)."""
        self._replaying = True
        try:
            batch = _decode(payload)
            for kind, origin, pid, *rest in batch:
                self._apply(int(kind), self._peer(int(origin), int(pid), now_s), rest)
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as exc:
            log.warning("dropped worker messages: %s: %s", type(exc).__name__, exc)
        finally:
            self._replaying = False

    def _peer(self, origin: int, pid: int, now_s: float) -> _Peer:
        peer = self.peers.get(origin)
        if peer is not None and peer.pid != pid:
            self.forget_peer(origin, now_s)  # restarted: its old requests died with it
            peer = None
        if peer is None:
            if not 0 <= origin < self.spec.num_workers or origin == self.spec.index:
                raise ValueError(f"message from unknown worker {origin}")
            peer = self.peers[origin] = _Peer(pid, now_s, {})
            if self.connected:
                self._connected.set()
        peer.last_heard_s = now_s
        return peer

    @property
    def connected(self) -> bool:
        """This worker has heard every peer (so its SUB receives from all of them)."""
        return len(self.peers) == self.spec.num_workers - 1

    @property
    def settled(self) -> bool:
        """Every worker, this one and all peers, says it is connected."""
        return self.connected and all(p.connected for p in self.peers.values())

    async def wait_connected(self, timeout_s: float) -> bool:
        """Until every peer is heard (True) or ``timeout_s`` passed (False)."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _apply(self, kind: int, peer: _Peer, rest: list[Any]) -> None:
        if kind == _KIND_DISPATCH:
            ticket_id, url, reason, request_id, model, hashes, prompt, max_tokens, now = rest[:9]
            # the session, so every worker's table sends the session's next turn home
            session = rest[9] if len(rest) > 9 and isinstance(rest[9], str) else None
            cacheable = rest[10] if len(rest) > 10 and isinstance(rest[10], bool) else True
            req = RouteRequest(request_id, model, hashes, prompt, max_tokens, session, cacheable)
            try:
                peer.shadows[ticket_id] = self.fleet.dispatch(
                    Decision(url, reason, 0, (url,)), req, now
                )
            except ValueError:
                return  # a backend this worker lacks (added through another's admin API)
        elif kind == _KIND_FIRST_TOKEN:
            ticket_id, now, cached = rest
            if ticket_id in peer.shadows:
                self.fleet.on_first_token(peer.shadows[ticket_id], now, cached)
        elif kind == _KIND_CACHED:
            ticket_id, cached = rest
            if ticket_id in peer.shadows:
                self.fleet.record_cached_tokens(peer.shadows[ticket_id], cached)
        elif kind == _KIND_FINISH:
            ticket_id, now, ok = rest
            shadow = peer.shadows.pop(ticket_id, None)
            if shadow is not None:
                self.fleet.finish(shadow, now, ok)
        elif kind == _KIND_HEARTBEAT:
            peer.connected = bool(rest[0]) if rest else False
        else:
            raise ValueError(f"unknown message kind {kind}")
        self.num_applied += 1

    def forget_peer(self, origin: int, now_s: float) -> None:
        """A peer died or restarted: finish (as failed) every shadow of its requests."""
        peer = self.peers.pop(origin, None)
        if peer is None:
            return
        self._connected.clear()
        if peer.shadows:
            log.warning("worker %d gone: releasing %d of its requests", origin, len(peer.shadows))
        self._replaying = True
        try:
            for shadow in peer.shadows.values():
                self.fleet.finish(shadow, now_s, False)
        finally:
            self._replaying = False

    def expire_silent_peers(self, now_s: float) -> None:
        for origin, peer in list(self.peers.items()):
            if now_s - peer.last_heard_s > self.spec.peer_timeout_s:
                self.forget_peer(origin, now_s)

    async def receive_forever(self, clock: Callable[[], float] = time.monotonic) -> None:
        while True:
            payload = await self.sub.recv()
            self.apply(payload, clock())
            while True:  # what else has arrived
                try:
                    payload = self._sub_now.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.apply(payload, clock())

    def send_heartbeat(self) -> None:
        """Tell the peers this worker is alive, who it is and whether it hears them all."""
        self._send(_KIND_HEARTBEAT, self.connected)

    async def heartbeat_forever(self, clock: Callable[[], float] = time.monotonic) -> None:
        while True:
            self.send_heartbeat()
            self.expire_silent_peers(clock())
            settled = self.settled
            await asyncio.sleep(self.spec.heartbeat_s if settled else self.spec.join_heartbeat_s)

    def close(self) -> None:
        self.pub.close(0)
        self.sub.close(0)


BUS: web.AppKey[FleetBus] = web.AppKey("kvroute_bus", FleetBus)


def attach_bus(app: web.Application, spec: BusSpec) -> None:
    """Run a FleetBus for the life of ``app`` (call before the app starts)."""

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        context = zmq.asyncio.Context()
        bus = FleetBus(spec, state.fleet, context)
        bus.install()
        app[BUS] = bus
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(bus.receive_forever(state.clock)),
            loop.create_task(bus.heartbeat_forever(state.clock)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for origin in list(bus.peers):
                bus.forget_peer(origin, state.clock())
            bus.close()
            context.term()
            log.info("worker bus: sent %d, applied %d", bus.num_sent, bus.num_applied)

    app.cleanup_ctx.append(lifecycle)
