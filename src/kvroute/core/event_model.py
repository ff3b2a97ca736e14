"""Exact mode: one engine's prefix cache as its KV events describe it, in router keys.

The engine names blocks by its own hashes (its seed and algorithm, possibly 32-byte
hashes cut to 64 bits). The router never needs to reproduce them: a ``BlockStored``
carries the blocks' token ids and the parent's engine hash, so the router computes its
own chained key for each block (``token_block_hashes`` seeded with the parent's router
key) and remembers engine hash -> router key. ``BlockRemoved`` maps back through that
table (llm-d's "dual key" design). A store whose parent the router never saw cannot be
keyed and is dropped (counted in ``num_orphans``). A chain at the root starts from
``ROOT_SEED``, or from ``chain_seed(salt, adapter)`` when the event's extra keys carry a
``cache_salt`` or it names a LoRA adapter, as the router keys such requests.

Speculative entries close the blind window between dispatch and the engine's first
``BlockStored``: the chosen backend is credited with the request's keys at once; an event
for a key confirms it (the speculation is dropped, the confirmed block stays), and the
``Fleet`` withdraws unconfirmed ones after a TTL or when the request fails.

A key is *present* when the engine holds a block with that key (confirmed) or a
speculation is pending. The index must see contiguous chains (core/index.py), but an
engine may drop a middle block while its children stay cached (a duplicate computed
block whose twin was evicted; a CPU offload). So the model exposes only *visible* keys:
present keys whose whole chain back to the root is present. The engine's own lookup
stops at the first missing block too, so invisible keys could never be hit anyway; they
become visible again when the missing parent is stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.core.index import CacheModel

# removed engine hash -> router key entries kept for late children: a child stored after
# its parent's removal names a recently removed parent, so one engine's capacity of
# removals is enough (and memory stays proportional to the engine, not to time: a fixed
# 65,536 per engine took a soak's router from 63 to ~90 MiB before it was full)
RETIRED_MIN = 1_024
RETIRED_MAX = 65_536


class EventCacheModel(CacheModel):
    """Router keys one engine holds (from its KV events) plus speculative keys.

    Invariants (``check_invariants``):
    - ``visible`` is exactly the present keys whose parent is a root seed or visible;
    - ``_seeds`` is ``ROOT_SEED`` plus the salted seeds that have present children;
    - every present key has its parent in ``_parent`` and is listed in its parent's
      ``_children``; absent keys are in neither;
    - ``_confirmed[k]`` counts the engine blocks mapped to k in ``_engine_to_key``.

    Capacity is the engine's business: the model never evicts on its own, so the global
    index cap does not evict from it (``oldest_seq`` is None) and ``capacity_blocks`` is
    informational (the scraped ``num_gpu_blocks``, or the size when that is larger).
    ``ExactSync`` caps ``num_stored`` instead: past the cap the view falls back.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.nominal_capacity = capacity_blocks
        self._engine_to_key: dict[int, int] = {}  # engine hash of a held block -> router key
        self._retired: OrderedDict[int, int] = OrderedDict()  # removed engine hash -> key
        self._confirmed: dict[int, int] = {}  # router key -> engine blocks holding it
        # router key -> tokens (one per request) of its pending speculations
        self._speculative: dict[int, set[int]] = {}
        self._next_anonymous = -1  # tokens of speculations made without one
        self._parent: dict[int, int] = {}  # present key -> parent key (a seed at the root)
        self._seeds: set[int] = {ROOT_SEED}  # chain roots: plain, and salted ones in use
        self._children: dict[int, set[int]] = {}  # key -> its present children
        self.visible: set[int] = set()  # present keys with a present chain to the root
        self.num_orphans = 0  # stored blocks dropped: parent engine hash never seen
        self.num_removed = 0  # engine blocks removed by events (evictions, resets)

    # -- CacheModel ----------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return max(self.nominal_capacity, len(self.visible))

    @property
    def nominal_capacity_blocks(self) -> int:
        return self.nominal_capacity

    def holds(self, block_hash: int) -> bool:
        return block_hash in self.visible

    def __len__(self) -> int:
        return len(self.visible)

    def blocks(self) -> Iterator[int]:
        """Visible keys, children before their parents (an LRU can be seeded from it)."""
        roots = [k for k in self.visible if self._parent[k] in self._seeds]
        out: list[int] = []
        stack: list[tuple[int, bool]] = [(k, False) for k in roots]
        while stack:
            key, expanded = stack.pop()
            if expanded:
                out.append(key)
                continue
            stack.append((key, True))
            stack.extend((c, False) for c in self._children.get(key, ()) if c in self.visible)
        return iter(out)

    def insert(
        self, block_hashes: Sequence[int], num_held: int, seq: int
    ) -> tuple[Sequence[int], list[int]]:
        """Speculate on a prompt's chain (the caller owns expiry; see ``speculate``)."""
        return self.speculate(block_hashes), []

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.nominal_capacity = capacity_blocks
        while len(self._retired) > self.retired_limit:
            self._retired.popitem(last=False)
        return []

    def oldest_seq(self) -> int | None:
        return None  # never evicted by the index: the engine decides

    def evict_oldest(self) -> int | None:
        return None

    # -- events ----------------------------------------------------------------------------

    def key_of(self, engine_hash: int) -> int | None:
        """The router key of an engine block hash the model has seen (None: unknown)."""
        key = self._engine_to_key.get(engine_hash)
        return key if key is not None else self._retired.get(engine_hash)

    def store(
        self,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        seed: int = ROOT_SEED,
    ) -> list[int]:
        """A ``BlockStored``: map each block to its router key; returns keys now visible.

        ``seed`` roots a chain that starts at the root (``chain_seed`` of its salt and
        adapter)."""
        if parent_engine_hash is None:
            parent: int | None = seed
            self._seeds.add(seed)
        else:
            parent = self.key_of(parent_engine_hash)
        if parent is None or block_size < 1:
            self.num_orphans += len(engine_hashes)
            return []
        keys = token_block_hashes(token_ids, block_size, parent)
        added: list[int] = []
        # a short token list (malformed event) keys only the blocks it covers
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            old = self._engine_to_key.get(engine_hash)
            if old is not None:  # the engine re-announced a block it holds
                parent = old
                continue
            self._engine_to_key[engine_hash] = key
            self._retired.pop(engine_hash, None)
            self._confirmed[key] = self._confirmed.get(key, 0) + 1
            if self._speculative.pop(key, None) is None and self._confirmed[key] == 1:
                self._make_present(key, parent, added)
            parent = key
        if seed != ROOT_SEED and seed not in self._children:
            self._seeds.discard(seed)  # nothing new under it (blocks already known)
        return added

    def remove(self, engine_hashes: Iterable[int]) -> list[int]:
        """A ``BlockRemoved``: returns keys no longer visible (unknown hashes: ignored)."""
        removed: list[int] = []
        for engine_hash in engine_hashes:
            key = self._engine_to_key.pop(engine_hash, None)
            if key is None:
                continue
            self._retire(engine_hash, key)
            self.num_removed += 1
            count = self._confirmed[key] - 1
            if count:
                self._confirmed[key] = count
                continue
            del self._confirmed[key]
            if key not in self._speculative:
                self._make_absent(key, removed)
        return removed

    def clear(self) -> list[int]:
        """``AllBlocksCleared``: every confirmed block goes; speculations stay."""
        return self.remove(list(self._engine_to_key))

    # -- speculation -----------------------------------------------------------------------

    def speculate(self, block_hashes: Sequence[int], token: int | None = None) -> list[int]:
        """Credit a dispatched prompt's chain (router keys, root first); returns new keys.

        ``token`` names this speculation (a ticket id) for ``unspeculate``: a key holds
        the tokens of every pending speculation, so withdrawing one request never takes
        back another's, even after the key was confirmed, evicted and speculated again.
        """
        if token is None:
            token = self._next_anonymous
            self._next_anonymous -= 1
        added: list[int] = []
        parent = ROOT_SEED
        for key in block_hashes:
            if key in self._confirmed:
                parent = key
                continue
            tokens = self._speculative.get(key)
            if tokens is None:
                self._speculative[key] = {token}
                self._make_present(key, parent, added)
            else:
                tokens.add(token)
            parent = key
        return added

    def unspeculate(self, block_hashes: Iterable[int], token: int) -> list[int]:
        """Withdraw speculation ``token`` (expired or failed); returns keys now gone."""
        removed: list[int] = []
        for key in block_hashes:
            tokens = self._speculative.get(key)
            if tokens is None or token not in tokens:
                continue  # confirmed meanwhile, withdrawn by a clear, or not ours
            tokens.discard(token)
            if tokens:
                continue
            del self._speculative[key]
            if key not in self._confirmed:
                self._make_absent(key, removed)
        return removed

    @property
    def num_stored(self) -> int:
        """Engine blocks the model maps (visible or not): what the exact view's cap counts."""
        return len(self._engine_to_key)

    @property
    def num_confirmed(self) -> int:
        return len(self._confirmed)

    @property
    def num_speculative(self) -> int:
        return len(self._speculative)

    def confirmed_keys(self) -> set[int]:
        return set(self._confirmed)

    # -- internals ---------------------------------------------------------------------------

    @property
    def retired_limit(self) -> int:
        return min(RETIRED_MAX, max(RETIRED_MIN, self.nominal_capacity))

    def _retire(self, engine_hash: int, key: int) -> None:
        self._retired[engine_hash] = key
        if len(self._retired) > self.retired_limit:
            self._retired.popitem(last=False)

    def _make_present(self, key: int, parent: int, out: list[int]) -> None:
        """Link a newly present key; it (and present descendants) show if the chain is whole."""
        self._parent[key] = parent
        siblings = self._children.get(parent)
        if siblings is None:
            self._children[parent] = {key}
        else:
            siblings.add(key)
        visible = self.visible
        if parent not in self._seeds and parent not in visible:
            return
        visible.add(key)
        out.append(key)
        if key not in self._children:
            return  # the common case: a new tail block
        stack = [c for c in self._children[key] if c not in visible]
        while stack:
            k = stack.pop()
            visible.add(k)
            out.append(k)
            stack.extend(c for c in self._children.get(k, ()) if c not in visible)

    def _make_absent(self, key: int, out: list[int]) -> None:
        """Unlink a key that is no longer present; it and its visible descendants hide."""
        parent = self._parent.pop(key)
        siblings = self._children[parent]
        siblings.discard(key)
        if not siblings:
            del self._children[parent]
            if parent != ROOT_SEED:
                self._seeds.discard(parent)  # a salted root with nothing left under it
        visible = self.visible
        if key not in visible:
            return
        visible.discard(key)
        out.append(key)
        if key not in self._children:
            return
        stack = [c for c in self._children[key] if c in visible]
        while stack:
            k = stack.pop()
            visible.discard(k)
            out.append(k)
            stack.extend(c for c in self._children.get(k, ()) if c in visible)

    def check_invariants(self) -> None:
        present = set(self._confirmed) | set(self._speculative)
        assert set(self._parent) == present, "event model: parent table != present keys"
        for key in present:
            assert key in self._children[self._parent[key]], "event model: child link"
        for parent, children in self._children.items():
            assert children, "event model: empty child set"
            for c in children:
                assert self._parent.get(c) == parent, "event model: stray child"
        for key in present:
            p = self._parent[key]
            whole = p in self._seeds or p in self.visible
            assert (key in self.visible) == whole, f"event model: visibility of {key}"
        assert self.visible <= present, "event model: visible key not present"
        assert self._seeds - {ROOT_SEED} <= set(self._children), "event model: idle seed"
        counts: dict[int, int] = {}
        for key in self._engine_to_key.values():
            counts[key] = counts.get(key, 0) + 1
        assert counts == self._confirmed, "event model: confirmed counts"
