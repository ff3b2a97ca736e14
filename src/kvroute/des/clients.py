"""The load generator in virtual time: ``kvroute bench``'s clients as events.

Each mode of ``LoadConfig`` is offered as ``bench/loadgen.py`` offers it over HTTP, with
the same random draws in the same order, so a simulated run sends what a real one would:

- closed: ``num_users`` users start together; each runs a session turn by turn (a turn
  waits for the previous answer, then the turn's own think time) and after a session
  thinks U(``think_time_s``) before the next;
- open: sessions start at Gamma arrivals of ``rates`` (``bench/arrivals.py``), trace: at
  their first turn's ``arrival_s``; with ``max_concurrency`` a request first waits for a
  free slot (first come, first served), and a session's start holds up the ones after it;
- warm-up: ``num_warmup`` requests (whole sessions) at most 16 at once, back to back,
  before the measured run; the run's clock starts when they are done.

The run stops issuing at ``num_requests`` measured requests or at ``duration_s``
(pauses are cut short there), then waits for the requests in flight. ``submit`` is the
simulation's door: it sends one request at a time ``at`` and later calls back with its
record, at the time the answer ended.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from kvroute.bench.load import LoadConfig, timed_sessions, warmup_concurrency, warmup_sessions
from kvroute.bench.loadgen import Progress, ProgressFn
from kvroute.bench.metrics import RequestRecord
from kvroute.bench.spec import RequestSpec, Session
from kvroute.des.events import OBSERVE, EventQueue

Done = Callable[[float, RequestRecord], None]
Then = Callable[[float], None]


class Submit(Protocol):
    def __call__(
        self, at: float, spec: RequestSpec, t0: float, warmup: bool, done: Done
    ) -> None: ...


class Slots:
    """A counting semaphore in virtual time: FIFO waiters, granted at release."""

    def __init__(self, size: int) -> None:
        self.free = size
        self._waiters: deque[Then] = deque()

    def acquire(self, at: float, then: Then) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            then(at)
        else:
            self._waiters.append(then)

    def release(self, at: float) -> None:
        if self._waiters:
            self._waiters.popleft()(at)  # the slot passes straight on
        else:
            self.free += 1


class VirtualClients:
    """Offers one workload under one ``LoadConfig`` (module doc); ``records`` as the
    HTTP load generator keeps them (warm-up first)."""

    def __init__(
        self,
        queue: EventQueue,
        sessions: Iterable[Session],
        load: LoadConfig,
        submit: Submit,
        *,
        progress: ProgressFn | None = None,
    ) -> None:
        self._queue, self._load, self._submit = queue, load, submit
        self._progress = progress
        self._sessions: Iterator[Session] = iter(sessions)
        self._rng = random.Random(load.seed)
        self._slots = Slots(load.max_concurrency) if load.max_concurrency else None
        self.records: list[RequestRecord] = []
        self._issued = self._scheduled = self._completed = self._failed = 0
        self._alive = 0  # client processes (users, scheduler, sessions) still running
        self.t0: float | None = None  # start of the measured run
        self.end: float | None = None  # when its last process ended
        self._deadline = math.inf
        self._on_end: Then = lambda _at: None
        self._due: deque[float] = deque()  # the scheduler's pending turns (_schedule_next)
        self._scheduling = False

    # -- phases ----------------------------------------------------------------------

    def start(self, at: float, on_run_start: Then, on_end: Then) -> None:
        """Warm up from ``at``, call ``on_run_start`` when the measured run starts and
        ``on_end`` when it ended (every answer in)."""
        self._on_end = on_end
        sessions = warmup_sessions(self._load, self._sessions)
        if not sessions:
            self._begin(at, on_run_start)
            return
        slots = Slots(warmup_concurrency(self._load))
        left = [len(sessions)]

        def session_done(end: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                self._begin(end, on_run_start)

        for session in sessions:
            self._warm_turn(at, session, 0, slots, at, session_done)

    def _warm_turn(
        self, at: float, session: Session, i: int, slots: Slots, t0: float, then: Then
    ) -> None:
        if i == len(session):
            then(at)
            return

        def send(at_: float) -> None:
            def done(end: float, record: RequestRecord) -> None:
                self.records.append(record)
                slots.release(end)
                self._warm_turn(end, session, i + 1, slots, t0, then)

            self._submit(at_, session[i], t0, True, done)

        slots.acquire(at, send)

    def _begin(self, at: float, on_run_start: Then) -> None:
        self.t0 = at
        if self._load.duration_s is not None:
            self._deadline = at + self._load.duration_s
        on_run_start(at)
        if self._load.mode == "closed":
            self._alive = self._load.num_users
            for _ in range(self._load.num_users):
                self._user(at)
        else:
            self._alive = 1
            self._timed = timed_sessions(self._load, self._sessions, self._rng)
            self._schedule_next(at)

    def _exit(self, at: float) -> None:
        self._alive -= 1
        if self._alive == 0:
            self.end = at
            self._on_end(at)

    # -- shared ----------------------------------------------------------------------

    def _may_issue(self, at: float) -> bool:
        bound = self._load.num_requests
        if bound is not None and self._issued >= bound:
            return False
        return at < self._deadline

    def _sleep(self, at: float, seconds: float, then: Then) -> None:
        """``then`` after ``seconds`` (cut at the deadline); at once when <= 0."""
        wake = min(at + seconds, self._deadline)
        if wake > at:
            self._queue.push(wake, OBSERVE, lambda t, _: then(t))
        else:
            then(at)

    def _record(self, record: RequestRecord, at: float) -> None:
        self.records.append(record)
        self._completed += record.ok
        self._failed += not record.ok
        if self._progress is not None:
            assert self.t0 is not None, "measured records come after the start"
            self._progress(
                Progress(
                    self._completed,
                    self._failed,
                    self._load.num_requests,
                    at - self.t0,
                    self._load.duration_s,
                )
            )

    def _run_session(self, at: float, session: Session, i: int, held: bool, then: Then) -> None:
        """Turn ``i`` onwards; ``held``: a slot is already taken for this turn."""
        if i == len(session) or not self._may_issue(at):
            if held:
                self._release(at)
            then(at)
            return
        self._issued += 1
        assert self.t0 is not None, "sessions run after the start"

        def done(end: float, record: RequestRecord) -> None:
            if held or self._slots is not None:
                self._release(end)
            self._record(record, end)
            if i + 1 < len(session):
                nxt = session[i + 1].think_time_s
                self._sleep(end, nxt, lambda t: self._run_session(t, session, i + 1, False, then))
            else:
                then(end)

        def send(at_: float) -> None:
            assert self.t0 is not None
            self._submit(at_, session[i], self.t0, False, done)

        if self._slots is None or held:
            send(at)
        else:
            self._slots.acquire(at, send)

    def _release(self, at: float) -> None:
        assert self._slots is not None, "only a taken slot is released"
        self._slots.release(at)

    # -- closed loop -----------------------------------------------------------------

    def _user(self, at: float) -> None:
        if not self._may_issue(at):
            self._exit(at)
            return
        session = next(self._sessions, None)
        if session is None:
            self._exit(at)
            return
        self._run_session(at, session, 0, False, self._after_session)

    def _after_session(self, at: float) -> None:
        lo, hi = self._load.think_time_s
        if hi > 0:
            self._sleep(at, self._rng.uniform(lo, hi), self._user)
        else:
            self._user(at)

    # -- open loop and trace -----------------------------------------------------------

    def _schedule_next(self, at: float) -> None:
        """The scheduler: the next session at its offset, once a slot is free.

        A session that is already due starts at once and asks for the next one from
        inside this call; the request waits in ``_due`` for the loop below instead of
        recursing, so a backlog (thousands of sessions due at one instant on a tiled
        fleet) does not exhaust the stack. The order of events is the recursion's: the
        request is always the last thing the started session does."""
        self._due.append(at)
        if self._scheduling:
            return
        self._scheduling = True
        try:
            while self._due:
                self._schedule_one(self._due.popleft())
        finally:
            self._scheduling = False

    def _schedule_one(self, at: float) -> None:
        bound = self._load.num_requests
        item = next(self._timed, None)
        if item is None or (bound is not None and self._scheduled >= bound):
            self._exit(at)
            return
        offset, session = item
        assert self.t0 is not None
        self._sleep(at, self.t0 + offset - at, lambda t: self._take_slot(t, session))

    def _take_slot(self, at: float, session: Session) -> None:
        if self._slots is not None:
            self._slots.acquire(at, lambda t: self._start_session(t, session))
        else:
            self._start_session(at, session)

    def _start_session(self, at: float, session: Session) -> None:
        if not self._may_issue(at):
            if self._slots is not None:
                self._release(at)
            self._exit(at)
            return
        self._scheduled += len(session)
        self._alive += 1
        self._run_session(at, session, 0, self._slots is not None, self._exit)
        self._schedule_next(at)
