"""Decode fast-forward: many decode-only steps of an engine at once, equal to stepping.

Between arrivals, finishes and prefill chunks, an engine's steps are all alike: every
running request decodes one token, the batch keeps its size B, and only the context
grows (by B tokens a step). Such a step's time is ``t_fwd0 + k_ctx * ctx + per_seq * B``
(engine/step_time.py) with ``ctx`` the only term that moves, so the steps ahead are known
without running them: ``decode_span`` gives their durations, and how many there can be
before something changes (a request reaches its length, or the blocks run out), from the
state alone. ``advance_decodes`` then applies k of them in one call: each request gets its
k tokens and its new blocks in the order stepping would give them, without building a
batch, a cost record or a token object per step.

The discrete-event simulator (kvroute.des) uses the two to treat such a run as one event
and to materialise it only when something looks at the engine. Equality with stepping is
by construction (the same block calls in the same order, the same duration function on
the same terms) and tested (tests/engine/test_fast_forward.py, tests/des/).
"""

from __future__ import annotations

from dataclasses import replace

from kvroute.engine.engine import Engine, EngineStats, token_span
from kvroute.engine.request import Request


def decode_batch(engine: Engine) -> int:
    """B when the engine's next step is decode-only and fast-forward is exact, else 0.

    Decode-only: nothing waits, every running request has its whole context computed
    but its last sampled token, and the budget covers one token each. Jittered step
    times draw from a random stream per step, so they are never fast-forwarded.
    """
    s = engine.scheduler
    running = s.running
    if s.waiting or not running or engine.step_time.jitter:
        return 0
    if len(running) > s.max_num_batched_tokens:
        return 0
    for req in running:
        n = len(req.token_ids)
        if req.num_computed_tokens != n - 1 or n <= req.num_prompt_tokens:
            return 0
    return len(running)


def decode_span(engine: Engine, max_steps: int) -> tuple[list[float], list[int]]:
    """Durations (engine seconds) of the decode-only steps ahead, at most ``max_steps``,
    that neither finish a request nor need more blocks than are free, and the blocks they
    take: element j of the second list is how many free blocks steps 0..j take together
    (``stats_after`` reads the engine's KV usage inside the span from it). ([], []) when
    the next step is not decode-only (``decode_batch``). Reads the engine, changes nothing."""
    batch = decode_batch(engine)
    if not batch or max_steps < 1:
        return [], []
    running = engine.scheduler.running
    limit = engine.profile.max_model_len
    bs = engine.block_manager.block_size
    ctx = 0
    steps = max_steps
    need_at = [0] * bs  # requests that take a new block at steps j with j % bs == i
    for req in running:
        n = len(req.token_ids)
        ctx += n
        # tokens before the request finishes: a step without a finish leaves one more
        left = min(req.max_tokens - (n - req.num_prompt_tokens), limit - n)
        steps = min(steps, left - 1)
        # step j computes token n + j (1-based): a new block when it starts one
        first = (-(n - 1)) % bs  # first step j with (n - 1 + j) % bs == 0
        need_at[first] += 1
    free = engine.block_manager.num_free_blocks
    taken: list[int] = []
    total = 0
    for j in range(max(0, steps)):
        total += need_at[j % bs]
        if total > free:
            break
        taken.append(total)
    return engine.step_time.decode_durations_s(ctx, batch, len(taken)), taken


def stats_after(engine: Engine, blocks_taken: int) -> EngineStats:
    """The engine's stats once the first steps of a decode span have run, ``blocks_taken``
    being what they took (``decode_span``): such steps change only the KV usage
    (no request starts, ends or waits, nothing is looked up), so this equals ``stats``
    after ``advance_decodes`` of them, without applying them."""
    stats = engine.stats
    if not blocks_taken:
        return stats
    bm = engine.block_manager
    used = bm.num_used_blocks + blocks_taken  # the integer ``usage`` divides, so equal bits
    return replace(stats, kv_cache_usage=used / bm.num_blocks)


def advance_decodes(engine: Engine, num_steps: int) -> None:
    """Apply ``num_steps`` decode-only steps, as ``decode_span`` allowed (its length at
    most): the same state as ``num_steps`` calls of ``engine.step()``, outputs dropped.

    A decode step changes the block manager only for a request whose token starts a block
    or fills one, once in ``block_size`` steps each; for the others ``append_slots`` takes
    its fast path and does nothing. So each request's tokens are appended at once (a block
    that fills hashes ids appended earlier, as when stepping), and only those calls are
    made, step by step in running order, so blocks are taken and filled in stepping's order.
    """
    running = engine.scheduler.running
    if num_steps < 1 or not running:
        return
    bs = engine.block_manager.block_size
    append_slots = engine.block_manager.append_slots
    next_token = engine.next_token
    busy: list[list[tuple[Request, int]]] = [[] for _ in range(bs)]  # step % bs -> calls
    starts = []
    for req in running:
        n = len(req.token_ids)  # step j computes token n + j (1-based), its KV the (n+j)-th
        starts.append(n)
        takes, fills = (1 - n) % bs, (-n) % bs  # steps that start a block, fill one
        busy[takes].append((req, n))
        if fills != takes:
            busy[fills].append((req, n))
        index = n - req.num_prompt_tokens
        ids = req.token_ids
        ids.extend(token_span(next_token, req.request_id, index, index + num_steps))
    for j in range(num_steps):
        for req, n in busy[j % bs]:
            req.num_computed_tokens = n - 1 + j
            ok = append_slots(req, 1)
            assert ok, "advance_decodes past decode_span's block bound"
    for req, n in zip(running, starts, strict=True):
        req.num_computed_tokens = n - 1 + num_steps
