"""Random KV event streams, dispatches and gaps keep the fleet and index invariants."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved
from tests.exact.helpers import BS, ENGINE_SEED, exact_fleet, request, stored, url

prompts = st.lists(st.integers(1, 3), min_size=1, max_size=5).map(
    lambda values: [v for v in values for _ in range(BS)]
)
backends = st.integers(0, 1)


class ExactFleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fleet = exact_fleet(n=2, mode="auto", ttl=1.0)
        self.fleet.index.fixed_cap = 12  # small: the cap meets exact models too
        self.seq = [-1, -1]
        self.now = 0.0
        self.tickets = []

    def _send(self, i: int, events, *, skip: int = 0) -> None:
        self.seq[i] += 1 + skip
        self.now += 0.01
        self.fleet.apply_kv_batch(url(i), self.seq[i], self.now, events, self.now)

    @rule(i=backends, ids=prompts, start=st.integers(0, 4))
    def store(self, i, ids, start):
        start = min(start, len(ids) // BS - 1)
        self._send(i, [stored(ids, start)])

    @rule(i=backends, ids=prompts, k=st.integers(0, 4))
    def remove(self, i, ids, k):
        hashes = token_block_hashes(ids, BS, ENGINE_SEED)
        self._send(i, [BlockRemoved([hashes[min(k, len(hashes) - 1)]])])

    @rule(i=backends)
    def clear(self, i):
        self._send(i, [AllBlocksCleared()])

    @rule(i=backends, lost=st.booleans())
    def gap(self, i, lost):
        self._send(i, [], skip=2)
        if lost:
            self.fleet.kv_gap_unfilled(url(i), self.seq[i])
            self._send(i, [])
        else:
            self.seq[i] -= 3  # the subscriber replays what it missed, then goes on
            for _ in range(3):
                self._send(i, [])

    @rule(ids=prompts)
    def dispatch(self, ids):
        r = request(f"r{len(self.tickets)}", ids)
        d = self.fleet.route(r, self.now)
        if d is not None:
            self.tickets.append(self.fleet.dispatch(d, r, self.now))

    @rule(ok=st.booleans())
    def finish(self, ok):
        if self.tickets:
            self.fleet.finish(self.tickets.pop(0), self.now, ok)

    @rule(dt=st.floats(0.0, 2.0))
    def advance(self, dt):
        self.now += dt
        self.fleet.route(request("probe", [1] * BS), self.now)

    @rule(i=backends)
    def restart(self, i):
        self.seq[i] = -1
        self._send(i, [])

    @invariant()
    def consistent(self):
        self.fleet.check_invariants()


ExactFleetMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestExactFleet = ExactFleetMachine.TestCase
