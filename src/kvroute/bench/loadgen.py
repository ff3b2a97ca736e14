"""The HTTP load generator: sends workload specs to an OpenAI endpoint and times them.

``send_request`` streams one request and measures it as ``vllm bench serve`` does (TTFT
at the first token chunk, one ITL per later chunk, usage from the final chunk); a
non-streaming request is one JSON answer, so its TTFT is the whole response time.
``LoadGenerator`` offers a workload in one of the ``LoadConfig`` modes; the runner
calls ``warmup()`` then ``run()``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp

from kvroute.bench.load import LoadConfig, timed_sessions, warmup_concurrency, warmup_sessions
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.spec import RequestSpec, Session
from kvroute.bench.sse import SseDecoder, read_chunk
from kvroute.bench.workloads.base import Workload


@dataclass(frozen=True, slots=True)
class Progress:
    """Handed to the progress callback after each measured request."""

    completed: int  # successful measured requests so far
    failed: int  # failed measured requests so far
    total: int | None  # num_requests bound, if any
    elapsed_s: float  # since the measured run started
    duration_s: float | None  # duration bound, if any


ProgressFn = Callable[[Progress], None]


@dataclass(slots=True)
class _Measure:
    """Mutable state of one request while its stream is read."""

    start: float
    ttft_s: float | None = None
    last: float = 0.0
    num_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    done: bool = False

    def on_payload(self, payload: str, now: float, itl: list[float]) -> None:
        chunk = read_chunk(payload)
        if chunk.error:
            self.error = chunk.error
        if chunk.has_token:
            if self.ttft_s is None:
                self.ttft_s = now - self.start
            else:
                itl.append(now - self.last)
            self.last = now
            self.num_chunks += 1
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.output_tokens = chunk.completion_tokens or self.output_tokens
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens
        self.done = self.done or chunk.done


async def send_request(
    session: aiohttp.ClientSession,
    target_url: str,
    spec: RequestSpec,
    *,
    t0: float,
    model: str | None = None,
    ignore_eos: bool = False,
    timeout_s: float = 600.0,
    default_backend: str | None = None,
    warmup: bool = False,
    stream: bool = True,
) -> RequestRecord:
    """Send ``spec`` to ``target_url`` (streaming unless ``stream`` is False) and measure
    it; never raises for HTTP trouble."""
    m = _Measure(start=time.perf_counter())
    itl: list[float] = []
    status = backend = decision = None
    predicted: int | None = None
    left: int | None = None
    try:
        async with session.post(
            target_url.rstrip("/") + spec.path,
            json=spec.body(model, stream=stream, ignore_eos=ignore_eos),
            headers=dict(spec.headers) if spec.headers else None,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status = resp.status
            backend = resp.headers.get("x-kvroute-backend")
            decision = resp.headers.get("x-kvroute-decision")
            if decision is not None:
                predicted = _int_header(resp, "x-kvroute-predicted-cached-tokens")
                left = _int_header(resp, "x-kvroute-left-cached-tokens") or 0
            if status != 200:
                m.error = f"HTTP {status}: {(await resp.text())[:300]}"
            elif stream:
                await _read_stream(resp, m, itl)
            else:
                _read_whole(await resp.read(), m, time.perf_counter())
    except TimeoutError:
        m.error = f"timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        m.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if m.error is None and m.ttft_s is None:
        m.error = "stream ended without a token"
    return RequestRecord(
        request_id=spec.request_id,
        prefix_group=spec.prefix_group,
        session_id=spec.session_id,
        turn=spec.turn,
        start_s=m.start - t0,
        ok=m.error is None,
        ttft_s=m.ttft_s,
        itl_s=tuple(itl),
        e2e_s=end - m.start,
        prompt_tokens=m.prompt_tokens or spec.num_prompt_tokens,
        output_tokens=m.output_tokens if m.output_tokens is not None else m.num_chunks,
        cached_tokens=m.cached_tokens,
        backend=backend or (default_backend if status is not None else None),
        decision=decision,
        predicted_cached_tokens=predicted,
        left_cached_tokens=left,
        status=status,
        error=m.error,
        warmup=warmup,
    )


def _int_header(resp: aiohttp.ClientResponse, name: str) -> int | None:
    """A header's integer value; None when absent or not an integer."""
    try:
        return int(resp.headers[name])
    except (KeyError, ValueError):
        return None


def _read_whole(raw: bytes, m: _Measure, now: float) -> None:
    """A non-streaming answer: one JSON body read like one stream payload (its text
    counts as the first token, its usage as the final chunk's; ``read_chunk`` reads a
    chat answer's ``message`` as a chunk's ``delta``)."""
    try:
        payload = raw.decode()
    except UnicodeDecodeError:
        m.error = "answer is not UTF-8"
        return
    m.on_payload(payload, now, [])
    if m.error is None and m.ttft_s is None:
        m.error = "answer without generated text"


async def _read_stream(resp: aiohttp.ClientResponse, m: _Measure, itl: list[float]) -> None:
    decoder = SseDecoder()
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        for payload in decoder.feed(data):
            m.on_payload(payload, now, itl)
        if m.done:
            return
    for payload in decoder.flush():
        m.on_payload(payload, time.perf_counter(), itl)


# A run stops early when the target has answered nothing (no HTTP status at all) for
# STOP_SILENT_S while at least STOP_UNANSWERED requests failed: a dead process or a wrong
# port would otherwise be hammered for the whole run. A restart of a few seconds, or a
# slow engine whose requests are still in flight, is not that.
STOP_SILENT_S = 10.0
STOP_UNANSWERED = 50


class LoadGenerator:
    """Offers one workload to one target under one ``LoadConfig``; collects the records."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target_url: str,
        workload: Workload,
        load: LoadConfig,
        *,
        model: str | None,
        default_backend: str | None,
        progress: ProgressFn | None = None,
    ) -> None:
        self._session, self._target, self._load = session, target_url, load
        self._model, self._default_backend = model, default_backend
        self._progress = progress
        self._sessions: Iterator[Session] = iter(workload.sessions())
        self._rng = random.Random(load.seed)
        self._sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        self.records: list[RequestRecord] = []
        self._issued = self._scheduled = self._completed = self._failed = 0
        self._t0 = 0.0
        self._deadline: float | None = None
        # a target gone for good (its process died, a wrong port) ends the run early
        self._last_answer = 0.0  # perf_counter of the last request the target answered
        self._unanswered = 0  # requests failed without any HTTP answer since then
        self.stopped: str | None = None  # why the run ended early, if it did

    async def warmup(self) -> None:
        """Send ``num_warmup`` requests (whole sessions) before the measured run."""
        t0 = time.perf_counter()
        sessions = warmup_sessions(self._load, self._sessions)
        sem = asyncio.Semaphore(warmup_concurrency(self._load))

        async def one(session: Session) -> None:
            for spec in session:
                async with sem:
                    self.records.append(await self._send(spec, t0, warmup=True))

        await asyncio.gather(*(one(s) for s in sessions))

    async def run(self) -> float:
        """The measured run; returns its duration (first send to last response end)."""
        self._t0 = self._last_answer = time.perf_counter()
        if self._load.duration_s is not None:
            self._deadline = self._t0 + self._load.duration_s
        if self._load.mode == "closed":
            await asyncio.gather(*(self._user() for _ in range(self._load.num_users)))
        else:
            await self._scheduled_run()
        return time.perf_counter() - self._t0

    def _may_issue(self) -> bool:
        if self.stopped is not None:
            return False
        bound = self._load.num_requests
        if bound is not None and self._issued >= bound:
            return False
        return self._deadline is None or time.perf_counter() < self._deadline

    async def _sleep(self, seconds: float) -> None:
        if self._deadline is not None:
            seconds = min(seconds, self._deadline - time.perf_counter())
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def _send(self, spec: RequestSpec, t0: float, *, warmup: bool = False) -> RequestRecord:
        return await send_request(
            self._session,
            self._target,
            spec,
            t0=t0,
            model=self._model,
            ignore_eos=self._load.ignore_eos,
            timeout_s=self._load.request_timeout_s,
            default_backend=self._default_backend,
            stream=self._load.stream,
            warmup=warmup,
        )

    async def _run_session(self, session: Session, held: bool = False) -> None:
        """Turns in order with their think times; ``held``: a slot is already taken for turn 0."""
        holding = held
        try:
            for i, spec in enumerate(session):
                if i > 0:
                    await self._sleep(spec.think_time_s)
                if not self._may_issue():
                    break
                self._issued += 1
                if self._sem is None or holding:
                    record = await self._send(spec, self._t0)
                else:
                    async with self._sem:
                        record = await self._send(spec, self._t0)
                if holding:
                    holding = False
                    self._release()
                self._record(record)
        finally:
            if holding:
                self._release()

    def _release(self) -> None:
        assert self._sem is not None, "only a held slot is released"
        self._sem.release()

    def _record(self, record: RequestRecord) -> None:
        self.records.append(record)
        self._completed += record.ok
        self._failed += not record.ok
        now = time.perf_counter()
        if record.status is not None:
            self._last_answer, self._unanswered = now, 0
        else:
            self._unanswered += 1
            silent_s = now - self._last_answer
            if self._unanswered >= STOP_UNANSWERED and silent_s >= STOP_SILENT_S:
                self.stopped = (
                    f"stopped early: the target answered nothing for {silent_s:.0f} s "
                    f"({self._unanswered} requests failed meanwhile; last: {record.error})"
                )
        if self._progress is not None:
            self._progress(
                Progress(
                    self._completed,
                    self._failed,
                    self._load.num_requests,
                    time.perf_counter() - self._t0,
                    self._load.duration_s,
                )
            )

    async def _user(self) -> None:
        lo, hi = self._load.think_time_s
        while self._may_issue():
            session = next(self._sessions, None)
            if session is None:
                return
            await self._run_session(session)
            if hi > 0:
                await self._sleep(self._rng.uniform(lo, hi))

    async def _scheduled_run(self) -> None:
        """Start each session at its offset; with a concurrency cap, wait for a free slot
        first (requests queue client-side in arrival order, as in vLLM's bench)."""
        tasks: list[asyncio.Task[None]] = []  # kept to the end so no error goes unseen
        bound = self._load.num_requests
        for offset, session in timed_sessions(self._load, self._sessions, self._rng):
            if bound is not None and self._scheduled >= bound:
                break
            await self._sleep(self._t0 + offset - time.perf_counter())
            if self._sem is not None:
                await self._sem.acquire()
            if not self._may_issue():
                if self._sem is not None:
                    self._release()
                break
            self._scheduled += len(session)
            tasks.append(asyncio.create_task(self._run_session(session, self._sem is not None)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
