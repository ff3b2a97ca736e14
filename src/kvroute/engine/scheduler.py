"""Continuous batching with chunked prefill, as vLLM V1 schedules.

Each step first gives every running request the tokens it still needs (one for a decode,
a chunk for a prefill still in progress), in running order, then admits waiting requests
first-come first-served, all within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences. Running order is admission order, and a prefill can only be
left partial by exhausting the token budget (after which nothing more is admitted), so
running decodes always come before the one unfinished prefill: "decodes first, then
prefill chunks". When a running request needs a block and none is free, the newest
running request is preempted (its blocks freed, back to the front of the waiting queue,
recomputed later); a step that preempted admits nobody.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvroute.engine.block_manager import BlockManager, PrefixHit
from kvroute.engine.request import Request, RequestStatus
from kvroute.engine.step_time import StepWork


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step runs: requests and their new tokens, and the work for the cost model."""

    scheduled: list[tuple[Request, int]]  # (request, num_new_tokens), in batch order
    work: StepWork  # the cost-model terms of this batch
    num_decode_seqs: int  # scheduled requests that decode one token


class Scheduler:
    """Waiting queue, running list and the prefix-cache counters (tokens).

    Counters follow vLLM's PrefixCacheStats: a request's lookup is counted once, when it
    is first scheduled (queries += prompt tokens, hits += cached tokens). A preempted
    request that is scheduled again is looked up again, and vLLM counts that second
    lookup apart (``preempted_*``; not in the exported counters), so a victim re-hitting
    its own blocks does not inflate the hit rate. We do the same.
    """

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests at the front
        self.running: list[Request] = []  # admission order, oldest first
        self.prefix_cache_queries = 0  # tokens looked up by first-time requests
        self.prefix_cache_hits = 0  # tokens of those found cached
        self.preempted_prefix_cache_queries = 0  # same, for re-scheduled preempted requests
        self.preempted_prefix_cache_hits = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop ``req`` wherever it is, freeing its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.block_manager.free(req)
        elif not req.status.is_finished:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED

    def finish(self, req: Request) -> None:
        """Free a running request that reached its length; ``drop_finished`` unlists it."""
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED_LENGTH

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch and allocate its blocks."""
        scheduled: list[tuple[Request, int]] = []
        budget, preempted = self._schedule_running(self.max_num_batched_tokens, scheduled)
        if not preempted:
            self._admit_waiting(budget, scheduled)
        return self._output(scheduled)

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[Request, int]]
    ) -> tuple[int, bool]:
        """Give running requests their tokens; returns the budget left and whether any
        request was preempted."""
        preempted = False
        running = self.running
        append_slots = self.block_manager.append_slots
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = len(req.token_ids) - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            while not append_slots(req, num_new):
                preempted = True
                if self._preempt_newest() is req:
                    return budget, preempted
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget, preempted

    def _preempt_newest(self) -> Request:
        victim = self.running.pop()
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        """Admit waiting requests FCFS while tokens, sequences and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.block_manager.lookup(req)
            num_new = min(req.num_tokens - hit.num_tokens, budget)
            if not self.block_manager.allocate(req, hit, num_new):
                break  # head-of-line blocking, as vLLM's FCFS queue
            self.waiting.popleft()
            self._record_lookup(req, hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

    def _record_lookup(self, req: Request, hit: PrefixHit) -> None:
        if req.num_preemptions:
            self.preempted_prefix_cache_queries += req.num_tokens
            self.preempted_prefix_cache_hits += hit.num_tokens
        else:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens

    @staticmethod
    def _output(scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        """Sum the cost-model terms of a batch (before its tokens count as computed)."""
        num_prefill = 0
        pairs = 0.0
        ctx = 0
        num_decode = 0
        for req, n in scheduled:
            m = req.num_computed_tokens
            num_tokens = len(req.token_ids)
            if n == 1 and m == num_tokens - 1 and num_tokens > req.num_prompt_tokens:
                num_decode += 1
                ctx += m + 1
            else:
                num_prefill += n
                pairs += n * (m + n / 2)
        work = StepWork(num_prefill, pairs, ctx, len(scheduled))
        return SchedulerOutput(scheduled, work, num_decode)

    def check_invariants(self) -> None:
        """Assert queue/status consistency and the block manager's invariants."""
        assert len(self.running) <= self.max_num_seqs, "more running than max_num_seqs"
        bs = self.block_manager.block_size
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, f"{req} in running list"
            assert len(req.block_table) >= -(-req.num_computed_tokens // bs), f"{req} short"
            assert req.num_computed_tokens <= req.num_tokens, f"{req} computed too much"
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{req}"
            assert not req.block_table and req.num_computed_tokens == 0, f"{req} holds KV"
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "a request both running and waiting"
        self.block_manager.check_invariants(r.block_table for r in self.running)
