"""EventCacheModel against a reference: engine events and per-request speculations.

The reference keeps the obvious state: the router keys the engine holds (confirmed), and
for every key the requests whose speculation on it is still pending. A key is present
when confirmed or speculated; the model must show exactly the present keys whose whole
chain to the root is present, whatever the order of stores, removals, speculations and
withdrawals.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.common.kv_events import BlockStored
from kvroute.core.event_model import EventCacheModel
from tests.exact.helpers import BS, engine_hashes, router_keys, stored

prompts = st.lists(st.integers(1, 3), min_size=1, max_size=4).map(
    lambda values: [v for v in values for _ in range(BS)]
)


class EventModelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = EventCacheModel(100)
        self.confirmed: set[int] = set()
        self.pending: dict[int, set[int]] = {}  # key -> tokens of pending speculations
        self.parent: dict[int, int | None] = {}  # key -> parent key (None: root)
        self.speculations: list[tuple[int, list[int]]] = []  # (token, keys), not withdrawn
        self.next_token = 1

    def _learn(self, ids: list[int]) -> list[int]:
        keys = router_keys(ids)
        for i, key in enumerate(keys):
            self.parent[key] = keys[i - 1] if i else None
        return keys

    @rule(ids=prompts)
    def store(self, ids):
        keys = self._learn(ids)
        e: BlockStored = stored(ids)
        self.model.store(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
        for key in keys:
            if key not in self.confirmed:
                self.confirmed.add(key)
                self.pending.pop(key, None)  # the engine's word replaces the guesses

    @rule(ids=prompts, k=st.integers(0, 3))
    def remove(self, ids, k):
        keys = self._learn(ids)
        k = min(k, len(keys) - 1)
        self.model.remove([engine_hashes(ids)[k]])
        self.confirmed.discard(keys[k])

    @rule(ids=prompts)
    def speculate(self, ids):
        keys = self._learn(ids)
        token, self.next_token = self.next_token, self.next_token + 1
        self.model.speculate(keys, token)
        for key in keys:
            if key not in self.confirmed:
                self.pending.setdefault(key, set()).add(token)
        self.speculations.append((token, keys))

    @rule(data=st.data())
    def withdraw(self, data):
        if not self.speculations:
            return
        i = data.draw(st.integers(0, len(self.speculations) - 1))
        token, keys = self.speculations.pop(i)
        self.model.unspeculate(keys, token)
        for key in keys:
            tokens = self.pending.get(key)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self.pending[key]

    @invariant()
    def shows_exactly_the_present_chains(self):
        present = self.confirmed | set(self.pending)

        def whole(key: int | None) -> bool:
            while key is not None:
                if key not in present:
                    return False
                key = self.parent[key]
            return True

        assert set(self.model.blocks()) == {k for k in present if whole(k)}
        assert self.model.num_speculative == len(self.pending)
        assert self.model.confirmed_keys() == self.confirmed
        self.model.check_invariants()


EventModelMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestEventModel = EventModelMachine.TestCase
