"""One simulated run: a workload, a fleet of engines, one router, in virtual time.

``simulate_router`` builds the parts (an ``Engine`` per backend behind a ``SimBackend``,
a ``SimRouter``, ``VirtualClients``), runs the event queue dry and returns the same
``BenchResult`` a ``kvroute compare`` run gives: result.json's keys (the engines' own
counters for the hit rate, the client's records for latencies) plus the ceilings
(des/ceilings.py) and the simulator's own figures under ``simulation``.

The path of a request, in engine seconds: the client sends at t; the router routes and
dispatches it at t; it enters its engine at t + ``Timing.request_overhead_s`` (the
proxy's added latency) + the profile's ``a_api_ms`` (the engine's API server); its tokens
leave the engine at the end of the steps that made them and reach the router and the
client then (the return path is folded into the way in). The router scrapes every engine
at t = 0 and then each scrape interval; in exact mode an engine's KV events reach the
router ``Timing.kv_event_delay_s`` after the step that produced them.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.bench.compare import add_decision_analysis
from kvroute.bench.fleet import EngineDelta, engine_deltas, fleet_results
from kvroute.bench.load import LoadConfig
from kvroute.bench.loadgen import ProgressFn
from kvroute.bench.metrics import EngineCounters, RequestRecord, summarize
from kvroute.bench.procs import RouterSpec
from kvroute.bench.runner import BenchResult
from kvroute.bench.spec import RequestSpec
from kvroute.bench.workloads.base import Workload
from kvroute.common.kv_events import KvEvent
from kvroute.des.backend import SimBackend
from kvroute.des.ceilings import Ceilings, PromptLog, ceilings
from kvroute.des.clients import Done, VirtualClients
from kvroute.des.events import ARRIVE, OBSERVE, EventQueue
from kvroute.des.prepare import PreparedSessions, Preparer
from kvroute.des.prompts import PromptEncoder
from kvroute.des.router import Routed, SimRouter
from kvroute.engine.engine import Engine, TokenOutput, size_error
from kvroute.engine.profiles import EngineProfile

# The proxy's added latency per request: kvroute's P50 overhead measured through the
# router in front of an instant backend (issue 15's figure, 0.43 ms), engine seconds.
DEFAULT_REQUEST_OVERHEAD_S = 0.0004
# KV events: the HTTP simulator publishes a step's events when the step ends. Measured on
# the HTTP rig (kvroute_backend_kv_lag_seconds, receive - publish of each backend's last
# batch, 32 backends of 4 exact runs): 0.14-0.60 ms, median 0.25 ms, at the end of the
# runs; a router busy routing applies them later, so the default is 1 ms.
DEFAULT_KV_EVENT_DELAY_S = 0.001


NO_BACKEND = "no backend may take the request"  # the router's 503


@dataclass(frozen=True, slots=True)
class Timing:
    """Latencies outside the engines (engine seconds)."""

    request_overhead_s: float = DEFAULT_REQUEST_OVERHEAD_S
    kv_event_delay_s: float = DEFAULT_KV_EVENT_DELAY_S

    def __post_init__(self) -> None:
        latencies = (self.request_overhead_s, self.kv_event_delay_s)
        if not all(0 <= s < math.inf for s in latencies):
            raise ValueError("Timing: latencies must be >= 0 and finite")


@dataclass(slots=True)
class _InFlight:
    """One request between send and end, as the client and the proxy hold it."""

    spec: RequestSpec
    routed: Routed
    sent_at: float
    t0: float
    warmup: bool
    done: Done
    num_prompt_tokens: int
    first_at: float | None = None
    last_at: float = 0.0
    itl: list[float] = field(default_factory=list)
    num_tokens: int = 0


def backend_urls(num_backends: int) -> list[str]:
    """The simulated backends' URLs (names only: nothing listens)."""
    width = len(str(max(0, num_backends - 1)))
    return [f"http://sim-{i:0{width}d}" for i in range(num_backends)]


class Simulation:
    """One router's run over one fleet (module doc)."""

    def __init__(
        self,
        spec: RouterSpec,
        profile: EngineProfile,
        num_backends: int,
        workload: Workload,
        load: LoadConfig,
        *,
        timing: Timing | None = None,
        fast_forward: bool = True,
        progress: ProgressFn | None = None,
        encoder: PromptEncoder | None = None,
        keep_itl: bool = True,
        urls: Sequence[str] | None = None,
        compute_ceilings: bool = True,
        router_config: str | None = None,
        prepare_ahead: bool | None = None,
    ) -> None:
        self.profile = profile
        self.fast_forward = fast_forward  # asked for (exact mode steps anyway)
        self.timing = timing or Timing()
        self.queue = EventQueue()
        self.urls = list(urls) if urls is not None else backend_urls(num_backends)
        if len(self.urls) != num_backends or len(set(self.urls)) != num_backends:
            raise ValueError(f"need {num_backends} distinct backend URLs, got {self.urls}")
        self.router = SimRouter(
            spec, self.urls, profile.name, router_config, max_model_len=profile.max_model_len
        )
        exact = self.router.exact
        self.backends = {
            url: SimBackend(
                url,
                Engine(profile, enable_kv_events=exact),
                self.queue,
                self,
                fast_forward=fast_forward and not exact,
                kv_events=exact,
            )
            for url in self.urls
        }
        prepare = Preparer(profile.block_size, encoder, keep_ids=exact)
        self.sessions = PreparedSessions(workload.sessions, prepare, parallel=prepare_ahead)
        self.clients = VirtualClients(
            self.queue, self.sessions, load, self._submit, progress=progress
        )
        # the ceilings' input: 8 bytes per prompt block sent, which grows with the run and
        # not with the fleet (much of a long-context run's memory); ``compute_ceilings`` False
        # skips it and the ceilings
        self.log = PromptLog(profile.block_size) if compute_ceilings else None
        # every measured inter-token gap, pooled (8 bytes each); records keep their own
        # only with ``keep_itl`` (a tuple of floats per request: the memory of big runs)
        self.itl_pool = array("d")
        self._keep_itl = keep_itl
        self._in_flight: dict[str, _InFlight] = {}
        self._next_id = 0
        self._running = True
        self._before: dict[str, EngineCounters] = {}
        self._after: dict[str, EngineCounters] = {}
        self._arrive_delay = self.timing.request_overhead_s + profile.a_api_ms / 1000.0

    # -- the run ------------------------------------------------------------------------

    def run(self) -> None:
        self._scrape(0.0, None)
        try:
            self.clients.start(0.0, self._on_run_start, self._on_run_end)
            self.queue.run()
        finally:
            self.sessions.close()
        assert not self._in_flight, "the run ended with requests in flight"

    def _on_run_start(self, at: float) -> None:
        self._before = self._counters(at)

    def _on_run_end(self, at: float) -> None:
        self._after = self._counters(at)
        self._running = False  # scrapes stop; the queue runs dry

    def engine_deltas(self) -> dict[str, EngineDelta]:
        """What each engine counted during the measured run."""
        return engine_deltas(self._before, self._after)

    def _counters(self, at: float) -> dict[str, EngineCounters]:
        out = {}
        for url, backend in self.backends.items():
            s = backend.stats(at)
            out[url] = EngineCounters(s.prefix_cache_queries, s.prefix_cache_hits, None)
        return out

    def _scrape(self, at: float, _: Any) -> None:
        if not self._running:
            return
        for url, backend in self.backends.items():
            self.router.scraped(url, backend.stats(at))
        interval = self.router.scrape_interval_s
        if interval > 0:
            self.queue.push(at + interval, OBSERVE, self._scrape)

    # -- requests -----------------------------------------------------------------------

    def _submit(self, at: float, spec: RequestSpec, t0: float, warmup: bool, done: Done) -> None:
        prepared = self.sessions.take(spec)
        ids, hashes = prepared.token_ids, prepared.token_hashes
        profile = self.profile
        self._next_id += 1
        rid = f"{self._next_id:x}"
        # a request no engine can run is routed and sent all the same, as the live router
        # does (it knows the context length, not the prompt's exact tokens), and the
        # engine answers 400 on arrival
        refusal = size_error(profile, len(ids), spec.max_tokens)
        if refusal is None and self.log is not None:
            self.log.add(hashes, len(ids), counted=not warmup)
        routed = self.router.route(at, rid, prepared, spec.max_tokens, spec.headers)
        if routed is None:
            done(at, _failed(spec, at - t0, warmup, NO_BACKEND, len(ids)))
            return
        r = _InFlight(spec, routed, at, t0, warmup, done, len(ids))
        if refusal is not None:
            self.queue.push(at + self._arrive_delay, ARRIVE, self._refused, (r, refusal))
            return
        self._in_flight[rid] = r
        backend = self.backends[routed.decision.backend]
        arrive = (rid, ids, spec.max_tokens, list(hashes))  # the engine extends its copy
        self.queue.push(at + self._arrive_delay, ARRIVE, backend.on_arrive, arrive)

    # -- what the engines hand out (des/backend.py's Outputs) ----------------------------

    def on_outputs(self, backend: SimBackend, outputs: list[TokenOutput], at: float) -> None:
        in_flight = self._in_flight
        for out in outputs:
            r = in_flight[out.request_id]
            r.num_tokens += 1
            if r.first_at is None:
                r.first_at = at
                self.router.first_token(r.routed, at)
            else:
                r.itl.append(at - r.last_at)
            r.last_at = at
            if out.finish_reason is not None:
                del in_flight[out.request_id]
                self._finish(r, at, out.num_cached_tokens)

    def on_decode_tokens(
        self, backend: SimBackend, request_ids: Sequence[str], times: Sequence[float]
    ) -> None:
        in_flight = self._in_flight
        for rid in request_ids:
            r = in_flight[rid]
            last, itl = r.last_at, r.itl
            for t in times:
                itl.append(t - last)
                last = t
            r.last_at = last
            r.num_tokens += len(times)

    def on_kv_events(self, backend: SimBackend, events: list[KvEvent], at: float) -> None:
        self.queue.push(
            at + self.timing.kv_event_delay_s, OBSERVE, self._deliver_kv, (backend.url, at, events)
        )

    def _deliver_kv(self, at: float, arg: tuple[str, float, list[KvEvent]]) -> None:
        url, published_at, events = arg
        self.router.kv_batch(url, published_at, events, at)

    def _refused(self, at: float, refused: tuple[_InFlight, str]) -> None:
        """The engine answered 400 (the request does not fit its context) on arrival."""
        r, error = refused
        self.router.refused(r.routed, at)
        record = _record(
            r.spec, r.sent_at - r.t0, r.warmup, ok=False, ttft_s=None, itl_s=(),
            e2e_s=at - r.sent_at, prompt_tokens=r.num_prompt_tokens, output_tokens=0,
            cached_tokens=None, status=400, error=error, **r.routed.headers(),
        )  # fmt: skip
        r.done(at, record)

    def _finish(self, r: _InFlight, at: float, cached: int) -> None:
        self.router.finished(r.routed, at, prompt_tokens=r.num_prompt_tokens, cached_tokens=cached)
        assert r.first_at is not None, "a finished request had a first token"
        record = _record(
            r.spec,
            r.sent_at - r.t0,
            r.warmup,
            ok=True,
            ttft_s=r.first_at - r.sent_at,
            itl_s=tuple(r.itl) if self._keep_itl else (),
            e2e_s=at - r.sent_at,
            prompt_tokens=r.num_prompt_tokens,
            output_tokens=r.num_tokens,
            cached_tokens=cached,
            status=200,
            **r.routed.headers(),
        )
        if not r.warmup:
            self.itl_pool.extend(r.itl)
        r.done(at, record)


def _record(spec: RequestSpec, start_s: float, warmup: bool, **measured: Any) -> RequestRecord:
    """The client's record of ``spec``: what the spec says, plus what was ``measured``."""
    return RequestRecord(
        request_id=spec.request_id,
        prefix_group=spec.prefix_group,
        session_id=spec.session_id,
        turn=spec.turn,
        start_s=start_s,
        warmup=warmup,
        **measured,
    )


def _failed(
    spec: RequestSpec, start_s: float, warmup: bool, error: str, num_tokens: int
) -> RequestRecord:
    return _record(
        spec, start_s, warmup, ok=False, ttft_s=None, itl_s=(), e2e_s=0.0,
        prompt_tokens=num_tokens, output_tokens=0, cached_tokens=None, backend=None,
        status=503 if error == NO_BACKEND else 400, error=error,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Speed:
    """How fast the simulator ran (wall clock: not part of the deterministic result)."""

    wall_s: float  # the run, ceilings included
    engine_time_s: float  # virtual seconds simulated (warm-up included)
    num_requests: int  # requests simulated (warm-up included)

    @property
    def x_real_time(self) -> float:
        return self.engine_time_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {
            "wall_s": self.wall_s,
            "engine_time_s": self.engine_time_s,
            "x_real_time": self.x_real_time,
            "requests": self.num_requests,
            "requests_per_s": self.requests_per_s,
        }


@contextlib.contextmanager
def fewer_collections(threshold: int = 100_000) -> Iterator[None]:
    """Run the body with the cyclic garbage collector's youngest generation collected
    every ``threshold`` allocations instead of 700. A run allocates millions of short-lived
    key lists and tuples and creates few reference cycles, so the default spends about a
    tenth of the whole Mooncake trace's wall time collecting (measured: 43.3 -> 40.1 s);
    the collector still runs, so a cycle cannot pile up without bound."""
    before = gc.get_threshold()
    gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate_router(
    spec: RouterSpec,
    profile: EngineProfile,
    num_backends: int,
    workload: Workload,
    load: LoadConfig,
    *,
    extra_config: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[BenchResult, Speed]:
    """Run ``workload`` under ``load`` through ``spec`` on ``num_backends`` engines.

    ``options`` are ``Simulation``'s keywords (timing, fast_forward, progress, encoder,
    keep_itl, urls, compute_ceilings, router_config: a kvroute YAML as ``kvroute serve
    --config`` takes, without backends; prepare_ahead: make the prompts' ids and keys in a
    child process, des/prepare.py, None: when a second core is there); ``extra_config`` is
    merged into the result's ``config``.
    ``keep_itl`` False: records carry no inter-token gaps (the ITL figures of the result
    come from the pooled gaps all the same), for runs of millions of requests. ``urls``:
    the backends' names (default ``http://sim-N``); a consistent-hash ring is built on them.
    ``compute_ceilings`` False: no ceilings (their keys are None), for runs whose prompt log
    would not fit in memory.

    The result is a function of the arguments alone (no clock, no date in it): the same
    seed gives the same bytes. How fast it ran comes back apart, as ``Speed``.
    """
    wall0 = time.perf_counter()
    sim = Simulation(spec, profile, num_backends, workload, load, **options)
    with fewer_collections():
        sim.run()
    records, itl_pool, log = sim.clients.records, sim.itl_pool, sim.log
    t0, end = sim.clients.t0 or 0.0, sim.clients.end or 0.0
    deltas = sim.engine_deltas()
    simulation = {
        "events": sim.queue.num_events,
        "engine_steps": sum(b.num_steps for b in sim.backends.values()),
        "fast_forwards": sum(b.num_spans for b in sim.backends.values()),
        "engine_time_s": end,
        "reuse_regime": sim.router.reuse_regime(),
    }
    config = {
        "target": "kvroute simulate",
        "model": profile.name,
        "backend_metrics": list(sim.urls),
        "unreadable_metrics": [],
        "load": load.to_json(),
        "time_unit": "engine seconds (virtual time)",
        "speedup": 1.0,
        "profile": profile.name,
        "num_backends": num_backends,
        "router_kind": spec.kind,
        "router_policy": spec.policy,
        "request_overhead_s": sim.timing.request_overhead_s,
        "kv_event_delay_s": sim.timing.kv_event_delay_s,
        "fast_forward": sim.fast_forward,
        **(extra_config or {}),
    }
    # the engines and the Fleet (a cycle through the clients' callbacks) go before the
    # ceilings' arrays come: on a million requests both are gigabytes
    del sim
    gc.collect()
    result = summarize(records, end - t0, itl_s=itl_pool)  # the same, records or not
    result.update(fleet_results(records, deltas))
    capacity_blocks = num_backends * profile.num_gpu_blocks
    if log is not None:
        result.update(ceilings(log, capacity_blocks).to_json())
    else:  # not computed: the keys are there, empty
        result.update(Ceilings(None, None, None, capacity_blocks).to_json())
    result["cache_ceiling_block_size"] = profile.block_size
    result["simulation"] = simulation
    result.update(workload=workload.describe(), router=spec.name, config=config)
    bench = BenchResult(result, records)
    add_decision_analysis(bench)
    speed = Speed(time.perf_counter() - wall0, end, len(records))
    return bench, speed
