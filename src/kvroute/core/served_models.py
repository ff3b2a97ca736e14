"""The models the fleet's backends list, and what routing needs per model, cached.

Every request asks, for its model: which backends may take it (``eligible``), what block
size its keys are cut to (``block_size``: the most common among those backends) and
which kind of keys it needs (``key_kind``). The answers change only when membership,
health, a backend's block size or a backend's exactness changes, so each is computed
once and kept until the Fleet (core/fleet.py) calls ``invalidate``.

A client picks the model name (any string), so the caches are keyed by the names some
backend lists, and None; every other name shares one key (``UNLISTED``): only the
backends whose models are unknown can serve it, so one entry answers for all of them
and client-chosen names cannot grow the caches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from kvroute.core.backend import Backend
from kvroute.core.config import KeyKind, Mode
from kvroute.core.kv_sync import ExactSync
from kvroute.core.load_order import Group, GroupKey

UNLISTED = GroupKey("unlisted")  # the cache key of every model name no backend lists


class ServedModels:
    """Listed-model counts and the per-model caches over the Fleet's ``backends``."""

    def __init__(
        self, backends: Mapping[str, Backend], sync: ExactSync, mode: str, default_block_size: int
    ) -> None:
        self._backends = backends  # the Fleet's, read only
        self._sync = sync  # which backends are exact (key kinds in auto mode)
        self._mode = mode
        self._default_block_size = default_block_size
        self.model_refs: dict[str, int] = {}  # model -> backends listing it
        # caches keyed by cache_key: listed models, None and UNLISTED only
        self.model_to_eligible: dict[Group | None, tuple[str, ...]] = {}
        self.model_to_block_size: dict[Group | None, int] = {}
        self.model_to_key_kind: dict[Group | None, KeyKind] = {}

    def count(self, models: Iterable[str], delta: int) -> None:
        """A backend listing ``models`` came (``delta`` 1) or went (-1)."""
        refs = self.model_refs
        for m in models:
            n = refs.get(m, 0) + delta
            if n:
                refs[m] = n
            else:
                del refs[m]

    def listed(self, model: str | None) -> str | None:
        """``model`` when some backend lists it, else None (a name a client made up)."""
        return model if model is not None and model in self.model_refs else None

    def cache_key(self, model: str | None) -> Group | None:
        """``model`` when some backend lists it (or None), else the one shared key."""
        return model if model is None or model in self.model_refs else UNLISTED

    def invalidate(self) -> None:
        self.model_to_eligible.clear()
        self.model_to_block_size.clear()
        self.model_to_key_kind.clear()

    def eligible(self, model: str | None) -> tuple[str, ...]:
        """Healthy, non-draining backends serving ``model``, by URL."""
        key = self.cache_key(model)
        cached = self.model_to_eligible.get(key)
        if cached is None:
            cached = tuple(
                sorted(u for u, b in self._backends.items() if b.is_orderable and b.serves(model))
            )
            self.model_to_eligible[key] = cached
        return cached

    def block_size(self, model: str | None) -> int:
        """Block size the keys of ``model`` are cut to: the most common among eligible backends."""
        key = self.cache_key(model)
        cached = self.model_to_block_size.get(key)
        if cached is not None:
            return cached
        default = self._default_block_size
        sizes = Counter(self._backends[u].block_size or default for u in self.eligible(model))
        # Most common; among equals the smaller (deterministic).
        size = min(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[0] if sizes else default
        self.model_to_block_size[key] = size
        return size

    def key_kind(self, model: str | None) -> KeyKind:
        """ "tokens" when ``model``'s requests need token keys (token_block_hashes over the
        engine's token ids): always in exact mode, in auto mode while one of its backends
        is exact; else "text" (prompt_block_hashes)."""
        key = self.cache_key(model)
        kind = self.model_to_key_kind.get(key)
        if kind is None:
            mode = self._mode
            synced = any(self._sync.is_exact(u) for u in self.eligible(model))
            tokens = mode == Mode.EXACT or (mode == Mode.AUTO and synced)
            kind = KeyKind.TOKENS if tokens else KeyKind.TEXT
            self.model_to_key_kind[key] = kind
        return kind

    def check_invariants(self) -> None:
        listed = Counter(m for b in self._backends.values() for m in b.models)
        assert listed == self.model_refs, "fleet: listed-model counts"
