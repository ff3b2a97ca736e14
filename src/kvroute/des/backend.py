"""One simulated engine in virtual time: an ``Engine``, its steps as events, fast-forward.

Each step is one STEP event at its start: the event hands out the tokens of the step
that just ended (``Outputs.on_outputs``), then runs the next step and schedules itself at
that step's end, as the HTTP simulator's engine loop does in real time. An engine with
nothing to do schedules nothing; a request that arrives wakes it at once.

Decode fast-forward (engine/fast_forward.py): when the next steps are decode-only, the
engine schedules one event at the end of the whole run of them instead of one per step.
Nobody needs those steps one by one: their tokens only extend each stream (their times
are known in advance), and no request starts or ends among them. A request arriving
earlier first calls ``catch_up``, which applies the steps that have started by then, so
it meets exactly the state stepping would have left; a metrics scrape reads that state
without applying anything (only the KV usage moves inside a run: ``stats_after``), so a
router that scrapes every 50 ms does not cut every run into pieces. The result equals
step-by-step simulation (tests/des/).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.common.kv_events import KvEvent
from kvroute.des.events import STEP, EventQueue
from kvroute.engine.engine import Engine, EngineStats, TokenOutput
from kvroute.engine.fast_forward import advance_decodes, decode_span, stats_after
from kvroute.engine.request import PromptIds

# decode steps taken in one fast-forward at most: a run is usually cut sooner (a request
# arrives), and the durations of steps never taken are wasted work; a longer run is
# taken as several fast-forwards, one after the other
MAX_SPAN_STEPS = 128
MIN_SPAN_STEPS = 2  # below this a fast-forward saves nothing


class Outputs(Protocol):
    """Where an engine's results go (the simulation: router and clients)."""

    def on_outputs(self, backend: SimBackend, outputs: list[TokenOutput], at: float) -> None:
        """The tokens of one step, due at ``at`` (its end)."""

    def on_decode_tokens(
        self, backend: SimBackend, request_ids: Sequence[str], times: Sequence[float]
    ) -> None:
        """Fast-forwarded decode steps: each request got one token at each of ``times``."""

    def on_kv_events(self, backend: SimBackend, events: list[KvEvent], at: float) -> None:
        """The KV events of one step, published at ``at`` (its end)."""


@dataclass(slots=True)
class _Span:
    """A fast-forwarded run of decode steps: step i starts at ``starts[i]``, ends at
    ``starts[i + 1]`` (the last at ``end``)."""

    starts: list[float]
    end: float
    taken: list[int]  # free blocks steps 0..i take together


class SimBackend:
    """An engine driven by the event queue (module doc)."""

    def __init__(
        self,
        url: str,
        engine: Engine,
        queue: EventQueue,
        sink: Outputs,
        *,
        fast_forward: bool = True,
        kv_events: bool = False,
    ) -> None:
        self.url = url
        self.engine = engine
        self._queue = queue
        self._sink = sink
        self._fast_forward = fast_forward
        self._kv_events = kv_events
        self._busy = False  # a STEP event is pending
        self._version = 0  # STEP events of an older version were superseded
        self._pending: list[TokenOutput] = []  # tokens of the step in progress
        self._span: _Span | None = None
        self.num_steps = 0  # engine steps run, fast-forwarded ones included
        self.num_spans = 0  # fast-forwards taken

    def add_request(
        self,
        at: float,
        request_id: str,
        token_ids: PromptIds,
        max_tokens: int,
        block_hashes: list[int] | None = None,
    ) -> None:
        """A request enters the engine at ``at`` (ValueError when it refuses it);
        ``block_hashes``: its prompt's, when known (the engine keeps the list)."""
        self.catch_up(at)
        self.engine.add_request(request_id, token_ids, max_tokens, block_hashes=block_hashes)
        if not self._busy:
            self._busy = True
            self._queue.push(at, STEP, self._on_step, self._version)

    def on_arrive(self, at: float, arg: tuple[str, Sequence[int], int, list[int]]) -> None:
        """The ARRIVE event: ``add_request`` with (request id, token ids, max tokens,
        block hashes)."""
        self.add_request(at, *arg)

    def stats(self, at: float) -> EngineStats:
        """The engine's gauges and counters as at ``at``. Inside a fast-forward they are
        computed, not stepped to: a scrape every 50 ms (the llm-d model's) would otherwise
        cut every run of decode steps into pieces."""
        span = self._span
        if span is None:
            return self.engine.stats
        return stats_after(self.engine, span.taken[self._num_started(span, at) - 1])

    @staticmethod
    def _num_started(span: _Span, at: float) -> int:
        """Steps of ``span`` started before ``at`` (the first started with the span)."""
        return max(1, bisect.bisect_left(span.starts, at))

    def catch_up(self, at: float) -> None:
        """Apply the fast-forwarded steps that started before ``at``; the one in
        progress then ends with a normal STEP event."""
        span = self._span
        if span is None:
            return
        done = self._num_started(span, at)
        self._apply_span(span, done)
        end = span.starts[done] if done < len(span.starts) else span.end
        self._version += 1
        self._queue.push(end, STEP, self._on_step, self._version)

    def _apply_span(self, span: _Span, num_steps: int) -> None:
        self._span = None
        running = [r.request_id for r in self.engine.scheduler.running]
        advance_decodes(self.engine, num_steps)
        self.num_steps += num_steps
        times = span.starts[1 : num_steps + 1]
        if num_steps == len(span.starts):
            times.append(span.end)
        self._sink.on_decode_tokens(self, running, times)

    def _on_step(self, at: float, version: int) -> None:
        if version != self._version:
            return  # superseded by catch_up
        span = self._span
        if span is not None:  # a fast-forward ran to its end
            self._apply_span(span, len(span.starts))
        outputs, self._pending = self._pending, []
        if outputs:
            self._sink.on_outputs(self, outputs, at)
        if self._kv_events:
            events = self.engine.drain_kv_events()
            if events:
                self._sink.on_kv_events(self, events, at)
        self._next_step(at)

    def _next_step(self, at: float) -> None:
        engine = self.engine
        if not engine.has_unfinished_requests():
            self._busy = False
            return
        if self._fast_forward:
            durations, taken = decode_span(engine, MAX_SPAN_STEPS)
            if len(durations) >= MIN_SPAN_STEPS:
                starts = [at]
                t = at
                for d in durations:
                    t += d
                    starts.append(t)
                end = starts.pop()
                self._span = _Span(starts, end, taken)
                self.num_spans += 1
                self._queue.push(end, STEP, self._on_step, self._version)
                return
        result = engine.step()
        self.num_steps += 1
        self._pending = result.outputs
        self._queue.push(at + result.duration_s, STEP, self._on_step, self._version)
