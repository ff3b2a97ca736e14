"""Exact mode's side of the Fleet: the methods that take each engine's KV event stream.

``Fleet`` (core/fleet.py) takes these as a mixin, so its callers keep one object: the
router's KV subscriber (router/kv_subscriber.py) feeds decoded batches and replay
results here and reads back where each stream stands (``kv_next_seq``, ``kv_stream``);
/admin/kv reads the exact views (``confirmed_keys``). The streams, the swaps between
exact and approximate views and the speculative credit are core/kv_sync.py's. What this
adds is what the rest of the Fleet must hear: a backend that turns exact or approximate
changes the key kind of its models (the per-model caches, core/served_models.py, are
dropped), and an event's block size is believed until a scrape reports one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from kvroute.common.kv_events import KvEvent
from kvroute.core.backend import Backend, parse_block_size
from kvroute.core.kv_sync import ExactSync, KvOutcome, KvStream
from kvroute.core.served_models import ServedModels

P = ParamSpec("P")
T = TypeVar("T")


class KvEventsMixin:
    """Fleet mixin: KV event intake (module doc). The Fleet's ``__init__`` sets these."""

    sync: ExactSync
    _backends: dict[str, Backend]
    _served: ServedModels

    def is_exact(self, url: str) -> bool:
        """True while ``url``'s view comes from its KV events."""
        return self.sync.is_exact(url)

    def apply_kv_batch(
        self,
        url: str,
        seq: int,
        ts: float,
        events: Sequence[KvEvent],
        now: float,
        *,
        lag_s: float | None = None,
    ) -> KvOutcome:
        """One decoded KV event batch of ``url`` (publisher sequence number ``seq``, engine
        timestamp ``ts``). On GAP nothing is applied: replay from ``kv_next_seq(url)`` and
        feed those batches here, then call ``kv_gap_unfilled`` if the gap remains."""
        b = self._backends.get(url)
        if b is None:
            return KvOutcome.UNKNOWN
        self.sync.expire(now)
        outcome = self._exact_change(
            self.sync.apply_batch, url, seq, ts, events, lag_s, b.block_size
        )
        if b.block_size is None:  # the engine's, as its first store it could key says
            s = self.sync.url_to_stream[url]
            size = parse_block_size(s.block_size)
            if size is not None:
                b.block_size = size
                self._served.invalidate()
        return outcome

    def kv_expect_parts(self, url: str, seq: int, parts: int) -> None:
        """The next ``apply_kv_batch`` of ``url`` is the first of ``parts`` calls that carry
        batch ``seq`` in order (a big batch applied in slices, the caller yielding between)."""
        self.sync.expect_parts(url, seq, parts)

    def kv_catch_up_begin(self, url: str) -> None:
        """A replay of ``url``'s history from seq 0 starts: the view it rebuilds is kept
        out of routing until ``kv_catch_up_end`` (core/kv_sync.py says why)."""
        self.sync.begin_catch_up(url)

    def kv_catch_up_end(self, url: str, complete: bool) -> None:
        """That replay ended; ``complete``: it reached the engine's present."""
        self._exact_change(self.sync.end_catch_up, url, complete)

    def kv_history_empty(self, url: str) -> None:
        """A replay from 0 returned nothing: the engine never published, its cache is empty."""
        self._exact_change(self.sync.history_empty, url)

    def kv_gap_unfilled(self, url: str, resume_seq: int) -> None:
        """Batches before ``resume_seq`` are lost for good: approximate until the next reset."""
        self._exact_change(self.sync.gap_unfilled, url, resume_seq)

    def kv_next_seq(self, url: str) -> int | None:
        """The batch number ``url``'s stream needs next (None: unknown backend)."""
        s = self.sync.url_to_stream.get(url)
        return s.next_seq if s is not None else None

    def kv_stream(self, url: str) -> KvStream | None:
        """A copy of ``url``'s stream record: last batch, lag, gaps, events, overflows
        (None: unknown backend)."""
        s = self.sync.url_to_stream.get(url)
        return dataclasses.replace(s) if s is not None else None

    def confirmed_keys(self, url: str) -> set[int] | None:
        """The keys ``url``'s exact view holds on its engine's word (its events), without
        the speculative ones; None while ``url`` is approximate."""
        model = self.sync.model(url)
        return model.confirmed_keys() if model is not None else None

    def _exact_change(
        self, change: Callable[Concatenate[str, P], T], url: str, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``change(url, ...)``, a call into the sync that may turn ``url`` exact or
        approximate, and with it the key kind of its models: then the caches go."""
        was_exact = self.sync.is_exact(url)
        out = change(url, *args, **kwargs)
        if self.sync.is_exact(url) != was_exact:
            self._served.invalidate()
        return out
