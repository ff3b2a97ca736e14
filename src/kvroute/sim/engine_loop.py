"""The engine loop of one simulated vLLM backend: an ``Engine`` driven in real time.

An ``EngineLoop`` owns an ``Engine`` and one asyncio task (the engine loop) that does what
vLLM's engine core does: ``r = engine.step()``, wait ``r.duration_s`` (divided by the
speedup, multiplied by a ``slow`` fault), then hand each produced token to the request
that owns it (a per-request ``TokenStream``). The loop sleeps on an ``asyncio.Event``
while the engine has nothing to do, so an idle backend costs nothing. The HTTP side is
apart: sim/api.py serves an ``EngineLoop`` and sim/server.py binds it to a port.

Speedup: the engine has no clock; the loop waits each step's modelled duration divided
by ``speedup`` (engine seconds = real seconds x speedup), so with ``--speedup 10`` a 0.7 s
prefill takes 70 ms of wall time and every modelled duration shrinks by the same factor.

The per-request API overhead ``a_api_ms`` of the profile is a sleep before the request
enters the engine, so it adds to TTFT and not to the engine's steps (docs/engine-model.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence

from kvroute.common.tokenizer import Tokenizer, default_tokenizer
from kvroute.engine.engine import Engine, TokenOutput
from kvroute.engine.profiles import EngineProfile
from kvroute.sim.faults import Faults
from kvroute.sim.kv_publisher import KvEventPublisher
from kvroute.sim.metrics import SimMetrics
from kvroute.sim.profiles import get_profile

FREE_STEPS_PER_YIELD = 256  # zero-time steps run before letting the handlers run


class TokenStream:
    """The tokens of one request, handed from the engine loop to its handler.

    Lighter than an ``asyncio.Queue`` (this is the hot path of the ``instant`` profile):
    the loop appends, and wakes a waiting handler once per delivery, or only when the
    request finishes if ``wake_on_finish`` (a non-streaming answer needs nothing sooner).
    """

    __slots__ = ("_items", "_waiter", "first_token_at", "wake_on_finish")

    def __init__(self, wake_on_finish: bool = False) -> None:
        self._items: list[TokenOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self.first_token_at: float | None = None  # loop time the first token was delivered
        self.wake_on_finish = wake_on_finish

    def push(self, out: TokenOutput, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self._items.append(out)
        waiter = self._waiter
        wake = not self.wake_on_finish or out.finish_reason is not None
        if wake and waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[TokenOutput]:
        """Every token delivered since the last take; waits for at least one."""
        while not self._items or (self.wake_on_finish and self._items[-1].finish_reason is None):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = self._items
        self._items = []
        return items


class EngineLoop:
    """One simulated vLLM engine core: engine, engine loop, metrics, KV events, faults."""

    def __init__(
        self,
        profile: EngineProfile | str,
        *,
        speedup: float = 1.0,
        kv_events_endpoint: str | None = None,
        kv_replay_endpoint: str | None = None,
        faults: Faults | None = None,
        model_name: str | None = None,
        seed: int = 0,
        jitter: float = 0.0,
    ) -> None:
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.speedup = speedup
        self.faults = faults if faults is not None else Faults()
        self.model_name = model_name or self.profile.name
        self.tokenizer: Tokenizer = default_tokenizer()
        self._words = list(self.tokenizer.word_ids())
        self.word_text = {t: self.tokenizer.decode([t]) for t in self._words}
        self.engine = Engine(
            self.profile,
            rng=random.Random(seed),
            jitter=jitter,
            enable_kv_events=kv_events_endpoint is not None,
            next_token=self._next_token,
        )
        self.metrics = SimMetrics(lambda: self.engine.stats, self.model_name)
        self._kv_endpoint = kv_events_endpoint
        self._kv_replay_endpoint = kv_replay_endpoint
        self.publisher: KvEventPublisher | None = None
        self._streams: dict[str, TokenStream] = {}
        self._seeds: dict[str, int] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.hung: set[asyncio.Future[None]] = set()  # requests held by a hang fault

    # ---- life cycle -------------------------------------------------------------
    @property
    def kv_endpoint(self) -> str | None:
        """The PUB endpoint subscribers connect to (None without KV events)."""
        return self.publisher.endpoint if self.publisher else self._kv_endpoint

    async def start_engine(self) -> None:
        """Start the engine loop (and bind the KV publisher); the app calls this."""
        if self._loop_task is not None:
            return
        if self._kv_endpoint is not None and self.publisher is None:
            self.publisher = KvEventPublisher(
                self._kv_endpoint, replay_endpoint=self._kv_replay_endpoint, faults=self.faults
            )
            self.publisher.start()
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._run(), name=self.task_name())

    def task_name(self) -> str:
        """The name of the engine loop's asyncio task."""
        return "sim-engine"

    async def stop_engine(self) -> None:
        for fut in list(self.hung):
            fut.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    # ---- requests ---------------------------------------------------------------
    def api_delay_s(self) -> float:
        """Wall seconds of the per-request API overhead (a_api, scaled)."""
        return self.profile.a_api_ms / 1000.0 * self.faults.slow_factor / self.speedup

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        seed: int,
        cache_salt: str | None = None,
        *,
        wake_on_finish: bool = False,
    ) -> TokenStream:
        """Add a request to the engine; its tokens arrive on the returned stream.

        Raises ValueError when the engine refuses it (too long for the model).
        """
        stream = TokenStream(wake_on_finish)
        self._seeds[request_id] = seed
        try:
            self.engine.add_request(request_id, prompt_token_ids, max_tokens, cache_salt=cache_salt)
        except ValueError:
            del self._seeds[request_id]
            raise
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Forget an unfinished request: the engine frees its blocks. Idempotent."""
        if self._streams.pop(request_id, None) is not None:
            self._seeds.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _next_token(self, request_id: str, index: int) -> int:
        seed = self._seeds.get(request_id, 0)
        x = (seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
        return self._words[(x >> 7) % len(self._words)]

    # ---- engine loop -----------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                await self._gather_arrivals()
                continue
            start = loop.time()
            outputs, duration_s = self._step()
            delay = duration_s * self.faults.slow_factor / self.speedup
            if delay > 0:
                await asyncio.sleep(start + delay - loop.time())
            else:
                await asyncio.sleep(0 if outputs else 0.001)  # never spin
            self._deliver(outputs)
            self.publish_kv_events()

    async def _gather_arrivals(self) -> None:
        """Yield while requests keep arriving (a few loop turns at most), so that requests
        that came together start in one batch instead of one zero-time step each."""
        for _ in range(8):
            before = len(self._streams)
            await asyncio.sleep(0)
            if len(self._streams) == before:
                return

    def _step(self) -> tuple[list[TokenOutput], float]:
        """One engine step; zero-time steps (``instant``) run back to back, up to a cap.

        Free steps take no modelled time, so their tokens are all due at once; running
        them together gives each request one delivery instead of one per token.
        """
        result = self.engine.step()
        if result.duration_s > 0 or not result.outputs:
            return result.outputs, result.duration_s
        outputs = list(result.outputs)
        for _ in range(FREE_STEPS_PER_YIELD):
            if not self.engine.has_unfinished_requests():
                break
            result = self.engine.step()
            outputs += result.outputs
            if result.duration_s > 0:
                return outputs, result.duration_s
        return outputs, 0.0

    def publish_kv_events(self) -> None:
        """Send the engine's pending KV events as one batch (no-op without a publisher)."""
        if self.publisher is not None:
            self.publisher.publish(self.engine.drain_kv_events(), time.time())

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        streams = self._streams
        now = asyncio.get_running_loop().time()
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream.push(out, now)
            if out.finish_reason is not None:
                del streams[out.request_id]
                self._seeds.pop(out.request_id, None)
