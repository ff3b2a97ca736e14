"""Fault injection for one simulated backend, for the router's reliability tests.

A backend's faults are one mutable ``Faults`` object: set at start from ``--fault``
flags (``parse_fault_spec``) and changed at run time through ``POST /sim/faults``
(``Faults.update``, a JSON object), read with ``GET /sim/faults``, cleared with
``DELETE /sim/faults``. Faults touch only the completion endpoints, except
``unhealthy`` (``/health``) and ``slow`` (the whole engine runs slower).

Spec grammar of ``--fault`` (repeatable): ``INDEX=KIND[:VALUE]`` where INDEX is a
backend index or ``all``, and KIND is one of

- ``error:500`` / ``error:503``: completions answer that status with a vLLM error body;
- ``hang``: completions are accepted and never answered (until the client gives up);
- ``slow:X``: every modelled duration (steps, API overhead) takes X times longer;
- ``drop:K``: the connection is closed after K chunks of a stream (non-streaming: after
  K tokens, with no response);
- ``unhealthy``: ``/health`` answers 503 (requests are still served);
- ``flap:S``: ``/health`` alternates between 200 and 503 every S seconds;
- ``kv_gap:K``: every K-th KV event batch is lost: its sequence number is used but the
  batch is neither sent nor kept for replay (a gap no replay can fill);
- ``kv_garbage:K``: after every K-th KV event batch one malformed message is also sent
  (kv_publisher.garbage_message: wrong frames, not msgpack, bad event shapes).

A backend process killed and restarted is not a fault of this object: the chaos
harness (bench/chaos.py) kills the ``kvroute sim`` process and starts it again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ERROR_STATUSES = (500, 502, 503, 504)
FAULT_KINDS = ("error", "hang", "slow", "drop", "unhealthy", "flap", "kv_gap", "kv_garbage")
FAULT_HELP = (
    "inject a fault, INDEX=KIND[:VALUE] (INDEX: backend index or 'all'); kinds: "
    "error:500|503 (completions fail), hang (never answer), slow:X (all durations x X), "
    "drop:K (close the connection after K stream chunks), unhealthy (/health 503), "
    "flap:S (/health 200/503 alternating every S s), kv_gap:K (every K-th KV batch lost), "
    "kv_garbage:K (a malformed KV message after every K-th batch). "
    "Repeatable. At run time: POST /sim/faults {...}, GET to read, DELETE to clear."
)


@dataclass(slots=True)
class Faults:
    """The faults active on one backend; the default is a healthy backend."""

    error_status: int | None = None  # completions answer this HTTP status; None: no error
    hang: bool = False  # completions never answer
    slow_factor: float = 1.0  # multiplies every modelled duration; 1.0: normal speed
    drop_after_chunks: int | None = None  # close the connection after this many chunks
    unhealthy: bool = False  # /health answers 503
    flap_s: float | None = None  # /health alternates 200 / 503 every this many seconds
    kv_gap_every: int | None = None  # every K-th KV batch is lost (unreplayable gap)
    kv_garbage_every: int | None = None  # a malformed KV message after every K-th batch

    def clear(self) -> None:
        """Back to a healthy backend."""
        for name, value in asdict(Faults()).items():
            setattr(self, name, value)

    def is_healthy(self, now_s: float) -> bool:
        """What ``/health`` says at loop time ``now_s`` (down in odd flap periods)."""
        if self.unhealthy:
            return False
        return self.flap_s is None or int(now_s / self.flap_s) % 2 == 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a JSON object of changes; ``{"clear": true}`` clears first.

        Keys are the field names (``error_status``, ``hang``, ``slow_factor``,
        ``drop_after_chunks``, ``unhealthy``) or the spec kinds (``error``, ``slow``,
        ``drop``). Raises ValueError naming a bad key or value; nothing is applied then.
        """
        if not isinstance(changes, dict):
            raise ValueError("faults must be a JSON object")
        staged = Faults(**self.to_json())
        if changes.get("clear") is True:
            staged.clear()
        for key, value in changes.items():
            if key != "clear":
                _set_field(staged, key, value)
        for name, value in staged.to_json().items():
            setattr(self, name, value)


_ALIASES = {
    "error": "error_status",
    "slow": "slow_factor",
    "drop": "drop_after_chunks",
    "flap": "flap_s",
    "kv_gap": "kv_gap_every",
    "kv_garbage": "kv_garbage_every",
}


def _set_field(faults: Faults, key: str, value: Any) -> None:
    name = _ALIASES.get(key, key)
    if name == "error_status":
        if value is not None and (_not_int(value) or value not in ERROR_STATUSES):
            raise ValueError(f"'{key}' must be one of {list(ERROR_STATUSES)} or null")
    elif name == "drop_after_chunks":
        if value is not None and (_not_int(value) or value < 0):
            raise ValueError(f"'{key}' must be an integer >= 0 or null")
    elif name in ("kv_gap_every", "kv_garbage_every"):
        if value is not None and (_not_int(value) or value < 1):
            raise ValueError(f"'{key}' must be an integer >= 1 or null")
    elif name == "slow_factor":
        if not _positive_number(value):
            raise ValueError(f"'{key}' must be a number > 0")
        value = float(value)
    elif name == "flap_s":
        if value is not None and not _positive_number(value):
            raise ValueError(f"'{key}' must be a number > 0 or null")
        value = None if value is None else float(value)
    elif name in ("hang", "unhealthy"):
        if not isinstance(value, bool):
            raise ValueError(f"'{key}' must be true or false")
    else:
        raise ValueError(f"unknown fault '{key}'; known: {[*_ALIASES, 'hang', 'unhealthy']}")
    setattr(faults, name, value)


def _not_int(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _positive_number(value: Any) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def parse_fault_spec(spec: str) -> tuple[int | None, dict[str, Any]]:
    """``"1=error:503"`` -> ``(1, {"error": 503})``; index None means all backends.

    Raises ValueError with the grammar on a malformed spec.
    """
    where, sep, what = spec.partition("=")
    kind, _, arg = what.partition(":")
    grammar = f"bad fault {spec!r}: expected INDEX=KIND[:VALUE], KIND in {list(FAULT_KINDS)}"
    if not sep or kind not in FAULT_KINDS:
        raise ValueError(grammar)
    index: int | None = None
    if where.strip() != "all":
        try:
            index = int(where)
        except ValueError:
            raise ValueError(grammar) from None
        if index < 0:
            raise ValueError(f"bad fault {spec!r}: backend index must be >= 0")
    try:
        if kind in ("hang", "unhealthy"):
            if arg:
                raise ValueError(grammar)
            change: dict[str, Any] = {kind: True}
        elif kind in ("slow", "flap"):
            change = {kind: float(arg)}
        else:
            change = {kind: int(arg)}
    except ValueError:
        raise ValueError(grammar) from None
    Faults().update(change)  # validates the value
    return index, change
