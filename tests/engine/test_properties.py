"""Hypothesis state machines: the block manager and the engine keep their invariants under
any sequence of operations (capacity, ref counts, hit bounds, tail-first eviction,
shared prefixes, every request finishing with exactly max_tokens tokens)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute.engine import Engine, TokenOutput
from kvroute.engine.block_manager import BlockManager
from kvroute.engine.request import Request

from .helpers import make_profile, make_request, run_to_completion

BS = 4
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def prompt(family: int, shared: int, suffix: list[int]) -> list[int]:
    """A prompt whose first ``shared`` tokens are common to its prefix family."""
    return [family * 1000 + i for i in range(shared)] + [5000 + t for t in suffix]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.held: list[Request] = []
        self.counter = 0

    @rule(
        family=st.integers(0, 2),
        shared=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 3), max_size=8),
    )
    def admit(self, family: int, shared: int, suffix: list[int]) -> None:
        tokens = prompt(family, shared, suffix)
        if not tokens:
            return
        self.counter += 1
        req = make_request(f"r{self.counter}", tokens, BS)
        hit = self.bm.lookup(req)
        assert hit.num_tokens <= req.num_tokens - 1
        assert hit.num_tokens == BS * len(hit.block_ids)
        max_blocks = (req.num_tokens - 1) // BS
        for other in self.held:  # a held, cached identical prefix is found and shared
            k = 0
            limit = min(other.num_cached_blocks, max_blocks)
            while (
                k < limit
                and other.block_hashes[k] == req.block_hashes[k]
                and self.bm.blocks[other.block_table[k]].block_hash == other.block_hashes[k]
            ):
                k += 1
            assert hit.block_ids[:k] == tuple(other.block_table[:k])
        num_new = req.num_tokens - hit.num_tokens
        free_before = self.bm.num_free_blocks
        if self.bm.allocate(req, hit, num_new):
            self.held.append(req)
        else:
            revived = sum(1 for b in hit.block_ids if self.bm.blocks[b].ref_cnt == 0)
            needed = -(-req.num_tokens // BS) - len(hit.block_ids)
            assert needed + revived > free_before, "refused although blocks were free"

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        table = list(req.block_table)
        self.bm.free(req)
        released = [b for b in reversed(table) if self.bm.blocks[b].ref_cnt == 0]
        if released:  # tail first, at the most-recently-used end of the queue
            assert self.bm.free_block_ids()[-len(released) :] == released

    @precondition(lambda self: self.held)
    @rule(data=st.data(), grow=st.integers(1, 9))
    def append(self, data: st.DataObject, grow: int) -> None:
        req = self.held[data.draw(st.integers(0, len(self.held) - 1))]
        req.num_computed_tokens = req.num_tokens
        before = list(req.block_table)
        if self.bm.append_slots(req, grow):
            req.token_ids.extend(range(7000, 7000 + grow))
            assert len(req.block_table) == -(-req.num_tokens // BS)
        else:
            assert req.block_table == before

    @rule()
    def reset(self) -> None:
        assert self.bm.reset() == (not self.held)

    @invariant()
    def consistent(self) -> None:
        assert self.bm.num_used_blocks <= self.bm.num_blocks
        self.bm.check_invariants([r.block_table for r in self.held])


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        profile = make_profile(
            block_size=BS,
            kv_capacity_tokens=64,
            max_model_len=64,
            max_num_seqs=3,
            max_num_batched_tokens=10,
        )
        self.engine = Engine(profile, enable_kv_events=True)
        self.expected: dict[str, tuple[int, int]] = {}  # id -> (prompt_len, max_tokens)
        self.outputs: dict[str, list[TokenOutput]] = {}
        self.aborted: set[str] = set()
        self.counter = 0

    @rule(
        family=st.integers(0, 2),
        shared=st.integers(1, 30),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        max_tokens=st.integers(1, 12),
    )
    def add(self, family: int, shared: int, suffix: list[int], max_tokens: int) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        tokens = prompt(family, shared, suffix)
        self.engine.add_request(rid, tokens, max_tokens)
        self.expected[rid] = (len(tokens), max_tokens)

    @rule()
    def step(self) -> None:
        result = self.engine.step()
        assert result.duration_s >= 0.0
        idle = not (result.outputs or result.num_prefill_tokens or result.num_decode_seqs)
        assert (result.duration_s == 0.0) == idle  # tiny has t_fwd0 > 0
        for out in result.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        self.engine.abort_request(rid)
        self.aborted.add(rid)

    @rule()
    def reset(self) -> None:
        assert self.engine.reset_prefix_cache() == (self.engine.stats.kv_cache_usage == 0.0)

    @invariant()
    def consistent(self) -> None:
        self.engine.check_invariants()
        stats = self.engine.stats
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert stats.num_running <= 3
        for rid, outs in self.outputs.items():
            assert outs[0].is_first and not any(o.is_first for o in outs[1:])
            assert outs[0].num_cached_tokens <= self.expected[rid][0] - 1

    def teardown(self) -> None:
        _, rest = run_to_completion(self.engine, max_steps=5000)
        for rid, outs in rest.items():
            self.outputs.setdefault(rid, []).extend(outs)
        for rid, (_, max_tokens) in self.expected.items():
            if rid in self.aborted:
                continue
            outs = self.outputs[rid]
            assert len(outs) == max_tokens
            assert [o.finish_reason for o in outs] == [None] * (max_tokens - 1) + ["length"]
        assert self.engine.stats.kv_cache_usage == 0.0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = SETTINGS
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = SETTINGS
