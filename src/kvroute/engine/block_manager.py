"""KV blocks with prefix caching, as in vLLM V1 (block pool + single-type manager).

A block's hash chains its parent's hash (the xxh3 seed) with its token ids, the same
keys ``common.hashing.token_block_hashes`` gives the router, so the engine's KV events
name blocks exactly as exact-mode routing does. A request's ``hash_seed`` is the chain
root: the shared root, or one mixed with extra keys (``cache_salt``, LoRA).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.common.hashing import token_block_hashes
from kvroute.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvroute.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One KV block as ``BlockManager.blocks`` shows it: who holds it and, once full and
    cached, the hash it is found by."""

    block_id: int  # index in the pool, 0..num_blocks-1
    ref_cnt: int  # running requests whose block table holds this block
    block_hash: int | None  # set when cached; kept after free until reused


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a request: what the scheduler needs, not the manager's maps."""

    block_ids: tuple[int, ...]  # cached blocks to reuse, in token order
    num_tokens: int  # tokens they cover (block_size * len(block_ids))


class BlockManager:
    """Allocates KV blocks to requests and keeps freed blocks findable by hash.

    Invariants (``check_invariants``):
    - every block is either free (``ref_cnt == 0``, in the free queue) or used
      (``ref_cnt > 0``, held by that many running requests), so free + used = total;
    - the free queue is in eviction order: least recently freed first, and among blocks
      freed together the request's tail blocks first, so a shared head survives longest;
    - ``hash_to_block[h] == b`` exactly when block b carries hash h (one block per hash:
      a block recomputed while its hash is already cached stays unhashed);
    - a cached block keeps its hash while free and loses it only when handed out again
      (lazy eviction), which emits ``BlockRemoved``.

    A block is two list entries, its ref count and its hash (``_ref``, ``_hash``, indexed
    by block id), not an object: the hot loops touch every block of every prompt. Blocks
    never handed out yet are not made until they are (the lists hold ids
    ``0..len(_ref)-1``): they sit at the front of the free queue in id order, as in a
    fresh vLLM pool, so the next ones taken are ``len(_ref)``, ``len(_ref) + 1``, ... and
    the queue is those, then ``_free`` (freed blocks). A fleet of large caches (1,024
    engines of 27,500 blocks) then costs memory for what it has used, not for what it
    could hold.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_events: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref: list[int] = []  # block id -> ref count, for ids handed out (class doc)
        self._hash: list[int | None] = []  # block id -> cached hash
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, queue order
        self._hash_to_block: dict[int, int] = {}
        self.enable_events = enable_events
        self._events: list[KvEvent] = []

    # -- queries ------------------------------------------------------------------------

    @property
    def blocks(self) -> list[KVBlock]:
        """The blocks handed out at least once, by id (a snapshot, for inspection)."""
        pairs = zip(self._ref, self._hash, strict=True)
        return [KVBlock(i, r, h) for i, (r, h) in enumerate(pairs)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self._ref)

    @property
    def num_used_blocks(self) -> int:
        return len(self._ref) - len(self._free)

    @property
    def usage(self) -> float:
        """Used blocks / all blocks, 0..1 (vllm:kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first = next to be reused)."""
        return [*range(len(self._ref), self.num_blocks), *self._free]

    def cached_block(self, block_hash: int) -> int | None:
        """The block carrying ``block_hash``, or None when it is not cached."""
        return self._hash_to_block.get(block_hash)

    def lookup(self, req: Request) -> PrefixHit:
        """Longest cached prefix of ``req`` in full blocks, leaving the last token to compute.

        vLLM caps the hit at ``num_tokens - 1`` tokens and keeps it block aligned, so a
        prompt that is a whole number of cached blocks recomputes its last block.
        """
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks)
        ids: list[int] = []
        get = self._hash_to_block.get
        for h in req.block_hashes[:max_blocks]:
            block_id = get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return PrefixHit(tuple(ids), len(ids) * self.block_size)

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, req: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Give a waiting request its hit blocks plus new ones for ``num_new_tokens``.

        Returns False, changing nothing, when the free blocks cannot cover it.
        """
        total = hit.num_tokens + num_new_tokens
        num_needed = -(-total // self.block_size) - len(hit.block_ids)
        ref = self._ref
        refs = list(map(ref.__getitem__, hit.block_ids))
        if num_needed + refs.count(0) > self.num_free_blocks:
            return False
        free = self._free
        for block_id, count in zip(hit.block_ids, refs, strict=True):
            if not count:
                del free[block_id]
            ref[block_id] = count + 1
        req.block_table = [*hit.block_ids, *self._new_blocks(num_needed)]
        req.num_cached_blocks = len(hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        self._cache_full_blocks(req, total)
        return True

    def append_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow a running request's table for ``num_new_tokens`` more tokens; False if full."""
        total = req.num_computed_tokens + num_new_tokens
        bs = self.block_size
        if total <= len(req.block_table) * bs and total < (req.num_cached_blocks + 1) * bs:
            return True  # fast path (most decodes): room in the last block, nothing fills
        num_needed = -(-total // bs) - len(req.block_table)
        if num_needed > self.num_free_blocks:
            return False
        req.block_table += self._new_blocks(num_needed)
        if total >= (req.num_cached_blocks + 1) * bs:
            self._cache_full_blocks(req, total)
        return True

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first, to the end of the free queue."""
        ref, free = self._ref, self._free
        for block_id in reversed(req.block_table):
            count = ref[block_id] - 1
            ref[block_id] = count
            if not count:
                free[block_id] = None
        req.block_table = []
        req.num_cached_blocks = 0

    def reset(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use, as in vLLM."""
        if self.num_used_blocks:
            return False
        self._hash = [None] * len(self._hash)
        self._hash_to_block.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KvEvent]:
        """Events queued since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # -- internals ------------------------------------------------------------------------

    def _new_blocks(self, count: int) -> list[int]:
        """Take the next ``count`` free blocks, evicting their cached hashes (lazy
        eviction), in queue order."""
        pop, ref, hashes = self._free.popitem, self._ref, self._hash
        hash_to_block = self._hash_to_block
        made = len(ref)
        fresh = min(count, self.num_blocks - made)  # never used: first in the queue
        taken = list(range(made, made + fresh))
        ref += [1] * fresh
        hashes += [None] * fresh
        for block_id in [pop(False)[0] for _ in range(count - fresh)]:
            h = hashes[block_id]
            if h is not None:
                del hash_to_block[h]
                if self.enable_events:
                    self._events.append(BlockRemoved([h]))
                hashes[block_id] = None
            ref[block_id] = 1
            taken.append(block_id)
        return taken

    def _ensure_hashes(self, req: Request, num_blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``num_blocks`` full blocks."""
        hashes = req.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self.block_size
        start = len(hashes)
        parent = hashes[-1] if hashes else req.hash_seed
        hashes += token_block_hashes(req.token_ids[start * bs : num_blocks * bs], bs, parent)

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the blocks that ``num_tokens`` scheduled tokens make full."""
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = req.num_cached_blocks
        if num_full <= start:
            return
        self._ensure_hashes(req, num_full)
        stored: list[int] = []
        hashes, table, block_hash = req.block_hashes, req.block_table, self._hash
        hash_to_block = self._hash_to_block
        for i in range(start, num_full):
            h = hashes[i]
            if h in hash_to_block:
                continue  # recomputed duplicate: the cached copy stays the one found
            block_id = table[i]
            block_hash[block_id] = h
            hash_to_block[h] = block_id
            stored.append(i)
        req.num_cached_blocks = num_full
        if self.enable_events and stored:
            self._emit_stored(req, stored)

    def _emit_stored(self, req: Request, indices: list[int]) -> None:
        """One BlockStored per contiguous run of newly cached block indices."""
        bs = self.block_size
        run_start = indices[0]
        for k, i in enumerate(indices):
            last = k + 1 == len(indices) or indices[k + 1] != i + 1
            if not last:
                continue
            parent = req.block_hashes[run_start - 1] if run_start else None
            extra = None  # vLLM: one entry per block; the salt is in the first block's
            if req.cache_salt is not None and not run_start:
                extra = [[req.cache_salt]] + [None] * (i - run_start)
            self._events.append(
                BlockStored(
                    req.block_hashes[run_start : i + 1],
                    parent,
                    list(req.token_ids[run_start * bs : (i + 1) * bs]),
                    bs,
                    extra_keys=extra,
                )
            )
            if k + 1 < len(indices):
                run_start = indices[k + 1]

    def check_invariants(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Assert the class invariants; with the running block tables, the ref counts too."""
        blocks = self.blocks
        assert len(self._ref) == len(self._hash) <= self.num_blocks, "block lists out of step"
        used = [b for b in blocks if b.ref_cnt > 0]
        assert len(used) + self.num_free_blocks == self.num_blocks, "free + used != total"
        for block_id in self._free:
            assert blocks[block_id].ref_cnt == 0, f"free block {block_id} has refs"
        assert all(b.ref_cnt >= 0 for b in blocks), "negative ref count"
        hashed = [b for b in blocks if b.block_hash is not None]
        assert len(hashed) == len(self._hash_to_block), "hashed blocks != hash map entries"
        for h, block_id in self._hash_to_block.items():
            assert blocks[block_id].block_hash == h, f"hash map -> wrong block {block_id}"
        if block_tables is not None:
            counts = [0] * self.num_blocks
            for table in block_tables:
                assert len(set(table)) == len(table), "a block twice in one table"
                for block_id in table:
                    counts[block_id] += 1
            for block in blocks:
                assert counts[block.block_id] == block.ref_cnt, (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders "
                    f"{counts[block.block_id]}"
                )
