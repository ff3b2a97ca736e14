"""Chained block hashes: the keys of the engine's prefix cache and of the router's index.

A block's key chains its parent's key (used as the xxh3 seed) with the block's content,
so equal keys mean equal prefixes up to and including that block, as in vLLM's prefix
cache. Only full blocks get a key: a partial tail block is never cached by the engine.

Two granularities: token blocks of ``block_size`` token ids (the engine's own keys, and
the router's in exact mode), and byte blocks of the UTF-8 text (the router's
approximate mode, core/keys.py).

The chain's root is ``ROOT_SEED``, or ``chain_seed(cache_salt, lora)`` for a request that
carries vLLM's ``cache_salt`` or runs on a LoRA adapter: the engine mixes them into its
first block's hash, so such requests share cache only with requests of the same salt
and adapter, and their keys must not match plain ones.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Sequence

import xxhash

ROOT_SEED = 0x6B76_726F_7574_6531  # "kvroute1": the parent of every first block
_MASK64 = (1 << 64) - 1


def chain_seed(cache_salt: str | None = None, lora: str | int | None = None) -> int:
    """The root of a request's key chain: requests with different salts or LoRA adapters
    never share KV (vLLM's extra keys); ``ROOT_SEED`` for a plain request."""
    if cache_salt is None and lora is None:
        return ROOT_SEED
    key = f"{cache_salt or ''}\x00{lora if lora is not None else ''}".encode()
    return xxhash.xxh3_64_intdigest(key, ROOT_SEED)


def text_block_hashes(text: str, block_chars: int, parent: int = ROOT_SEED) -> list[int]:
    """Chained keys of the full ``block_chars``-byte blocks of ``text`` (UTF-8)."""
    return byte_block_hashes(text.encode(), block_chars, parent)


def byte_block_hashes(data: bytes, block_chars: int, parent: int = ROOT_SEED) -> list[int]:
    """Chained keys of the full ``block_chars``-byte blocks of ``data``."""
    return _RUNS.chain(data, block_chars, parent)


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_SEED
) -> list[int]:
    """Chained keys of the full ``block_size``-token blocks of ``token_ids``."""
    try:
        if isinstance(token_ids, array) and token_ids.typecode == "Q":
            data = token_ids.tobytes()
        else:
            data = array("Q", token_ids).tobytes()  # ids in [0, 2**64): no per-id work
    except (OverflowError, TypeError):
        data = array("Q", [t & _MASK64 for t in token_ids]).tobytes()
    return _RUNS.chain(data, block_size * 8, parent)


def _chain(data: bytes, step: int, parent: int) -> list[int]:
    """The keys of ``data``'s full ``step``-byte blocks, one xxh3 call each."""
    hashes = []
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - step + 1, step):
        parent = digest(data[start : start + step], parent)
        hashes.append(parent)
    return hashes


class RunCache:
    """``_chain`` a run of ``run_blocks`` blocks at a time, remembering each run's keys.

    Most of a long prompt repeats (a system prompt, a document, earlier turns), so most
    of its keys were computed before. A run is looked up by its parent key and a 128-bit
    hash of its bytes (one fast pass over them instead of a call per block); runs start
    at the prompt's beginning, so a shared prefix hits on every whole run inside it, and
    the blocks after the last whole run are chained directly. The keys are exactly
    ``_chain``'s. Bounded: two generations of at most ``max_runs / 2`` runs each; when
    the current one is full it becomes the previous one and the oldest is dropped (a hit
    in the previous one moves up). Safe to share between threads: each step is one dict
    operation or one assignment.
    """

    def __init__(self, run_blocks: int = 32, max_runs: int = 1 << 15) -> None:
        self.run_blocks = run_blocks
        self.max_runs = max_runs
        self._current: dict[tuple[int, int, int], list[int]] = {}
        self._previous: dict[tuple[int, int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def chain(self, data: bytes, step: int, parent: int) -> list[int]:
        run = step * self.run_blocks
        if len(data) < 2 * run:  # short: chaining directly is as fast
            return _chain(data, step, parent)
        whole = xxhash.xxh3_128_intdigest
        out: list[int] = []
        end = len(data) - len(data) % run
        start = 0
        while start < end:
            key = (parent, step, whole(data[start : start + run]))
            keys = self._current.get(key) or self._previous.get(key)
            if keys is None:
                break  # every later run has a new parent: none of them can be known
            if key not in self._current:
                self._keep(key, keys)
            out += keys
            parent = keys[-1]
            start += run
        fresh = _chain(data[start:], step, parent)
        out += fresh
        for k in range(0, end - start, run):  # remember the new runs
            keys = fresh[k // step : (k + run) // step]
            self._keep((parent, step, whole(data[start + k : start + k + run])), keys)
            parent = keys[-1]
        return out

    def _keep(self, key: tuple[int, int, int], keys: list[int]) -> None:
        if len(self._current) >= max(1, self.max_runs // 2):
            self._previous, self._current = self._current, {}
        self._current[key] = keys


_RUNS = RunCache()


def leading_in(chain: Sequence[int], present: Container[int], lo: int = 0) -> int:
    """End of the run of ``chain``'s keys (from ``lo``, known present) found in ``present``,
    by binary search: a store of whole chains holds a key only with all its ancestors, so
    the keys it holds form a prefix of the chain."""
    hi = len(chain)
    while lo < hi:
        mid = (lo + hi) // 2
        if chain[mid] in present:
            lo = mid + 1
        else:
            hi = mid
    return lo
