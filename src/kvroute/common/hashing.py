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
    hashes = []
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - block_chars + 1, block_chars):
        parent = digest(data[start : start + block_chars], parent)
        hashes.append(parent)
    return hashes


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_SEED
) -> list[int]:
    """Chained keys of the full ``block_size``-token blocks of ``token_ids``."""
    try:
        data = array("Q", token_ids).tobytes()  # ids in [0, 2**64): no per-id work
    except (OverflowError, TypeError):
        data = array("Q", [t & _MASK64 for t in token_ids]).tobytes()
    step = block_size * 8
    hashes = []
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - step + 1, step):
        parent = digest(data[start : start + step], parent)
        hashes.append(parent)
    return hashes


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
