"""The engines' side of the Fleet: what they report about themselves, and what it reports.

``Fleet`` (core/fleet.py) takes these as a mixin. Two sources tell the router how big
each engine's cache is and what a key block stands for: scrapes of its /metrics
(``update_engine_stats``: queue gauges, KV usage, block size, cache size, prefix-cache
counters; router/scraper.py) and, in approximate mode, the prompt tokens each response's
usage reports against the bytes of text the router keyed (``observe_prompt_tokens``,
core/calibration.py). Approximate mode keys text in blocks of ``block_size * 4`` bytes,
so the learned bytes per token scale a prompt's tokens (``prompt_tokens_estimate``), a
key block's tokens (``key_block_tokens``) and each cache model's capacity in key blocks
(engine blocks x bytes per token / 4). Keys are never recut, so the index stays valid
when the estimate moves. ``backend_states`` reports all of it per backend.
"""

from __future__ import annotations

from collections.abc import Callable

from kvroute.core.backend import Backend, BackendState
from kvroute.core.calibration import TextCalibration, key_block_tokens, key_capacity_blocks
from kvroute.core.config import FleetConfig
from kvroute.core.index import PrefixIndex
from kvroute.core.keys import CHARS_PER_TOKEN
from kvroute.core.kv_sync import ExactSync
from kvroute.core.served_models import ServedModels


class EngineReportsMixin:
    """Fleet mixin: engine metrics, text calibration, snapshots (module doc). The
    Fleet's ``__init__`` sets these, and ``_reorder`` moves a backend in the load order."""

    config: FleetConfig
    index: PrefixIndex
    sync: ExactSync
    calibration: TextCalibration
    _backends: dict[str, Backend]
    _served: ServedModels
    _reorder: Callable[[Backend], None]

    def update_engine_stats(
        self,
        url: str,
        *,
        num_running: int | None = None,
        num_waiting: int | None = None,
        kv_cache_usage: float | None = None,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        prefix_cache_hits: int | None = None,
        prefix_cache_queries: int | None = None,
    ) -> None:
        """Feed one scrape of a backend's /metrics (None = not reported). Unknown URL: no-op."""
        b = self._backends.get(url)
        if b is None:
            return
        size_changed, has_capacity = b.observe_engine(
            num_running, num_waiting, kv_cache_usage, block_size, num_gpu_blocks
        )
        if size_changed:
            self._served.invalidate()
        if has_capacity:
            self._apply_capacity(b)
        b.engine.observe(prefix_cache_hits, prefix_cache_queries)
        self._reorder(b)

    def observe_prompt_tokens(self, model: str | None, text_bytes: int, prompt_tokens: int) -> None:
        """An engine counted ``prompt_tokens`` (its usage) for a prompt the router keyed
        from ``text_bytes`` UTF-8 bytes of text: the bytes-per-token estimate learns.
        A name no backend lists teaches only the pooled estimate (clients pick names)."""
        key = self._served.listed(model)
        if self.calibration.observe(key, text_bytes, prompt_tokens):
            for b in self._backends.values():  # rare: the estimate moved past its band
                self._apply_capacity(b)

    def prompt_tokens_estimate(self, model: str | None, text_bytes: int) -> int:
        """Tokens of a text prompt of ``text_bytes`` UTF-8 bytes, for ``model``'s engines."""
        key = self._served.listed(model)
        return self.calibration.estimate_tokens(key, text_bytes)

    def prompt_tokens_learned(self, model: str | None) -> bool:
        """Whether ``prompt_tokens_estimate`` for ``model`` rests on engines' answers (else
        on the built-in ratio of 4 bytes a token)."""
        return self.calibration.is_learned(self._served.listed(model))

    def key_block_tokens(self, model: str | None, block_size: int) -> int:
        """Tokens one key block of ``model`` stands for on an engine with ``block_size``:
        the block size itself, except for text keys (approximate mode; auto mode until a
        backend of the model is synced), where a block of ``block_size * 4`` bytes holds
        ``block_size * 4 / bytes_per_token`` tokens."""
        return key_block_tokens(block_size, self._key_bytes_per_token(model))

    def _key_bytes_per_token(self, model: str | None) -> float:
        """Bytes per token behind ``model``'s key blocks: 4 (no scaling) for token keys."""
        if self._served.key_kind(model) != "text":
            return CHARS_PER_TOKEN
        return self.calibration.bytes_per_token(self._served.listed(model))

    def _engine_capacity(self, b: Backend) -> int:
        """Engine blocks of ``b``'s cache: scraped, else the default."""
        return b.num_gpu_blocks or self.config.default_capacity_blocks

    def _key_capacity(self, b: Backend) -> int:
        """``b``'s cache model capacity in key blocks. Outside approximate mode, engine
        blocks: keys are the engine's own blocks there, or become them once a backend
        syncs (auto mode's text keys meanwhile are held at one engine block each)."""
        blocks = self._engine_capacity(b)
        if self.config.mode != "approximate":
            return blocks
        return key_capacity_blocks(blocks, self.calibration.mean_bytes_per_token(b.models))

    def _apply_capacity(self, b: Backend) -> None:
        if b.url in self.index.url_to_model:
            self.index.set_capacity(b.url, self._key_capacity(b))

    def backend_states(self, now: float | None = None) -> list[BackendState]:
        """A snapshot of each backend, by URL. ``now``: first withdraw the speculative
        credit whose TTL has passed (a page read while no request comes to do it)."""
        if now is not None:
            self.sync.expire(now)
        return [self._state(self._backends[u]) for u in sorted(self._backends)]

    def _state(self, b: Backend) -> BackendState:
        key_capacity = self.index.url_to_model[b.url].capacity_blocks
        # approximate mode: the engine's blocks (its key blocks are scaled from them)
        approximate = self.config.mode == "approximate"
        return b.state(
            block_size=b.block_size or self.config.default_block_size,
            capacity_blocks=self._engine_capacity(b) if approximate else key_capacity,
            index_blocks=self.index.num_blocks(b.url),
            stream=self.sync.url_to_stream[b.url],
            exact=self.sync.model(b.url),
            bytes_per_token=self.calibration.mean_bytes_per_token(b.models),
            key_capacity_blocks=key_capacity,
        )
