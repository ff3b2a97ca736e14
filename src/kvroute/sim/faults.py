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
- ``unhealthy``: ``/health`` answers 503 (requests are still served).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ERROR_STATUSES = (500, 502, 503, 504)
FAULT_KINDS = ("error", "hang", "slow", "drop", "unhealthy")
FAULT_HELP = (
    "inject a fault, INDEX=KIND[:VALUE] (INDEX: backend index or 'all'); kinds: "
    "error:500|503 (completions fail), hang (never answer), slow:X (all durations x X), "
    "drop:K (close the connection after K stream chunks), unhealthy (/health 503). "
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

    def clear(self) -> None:
        """Back to a healthy backend."""
        self.error_status = None
        self.hang = False
        self.slow_factor = 1.0
        self.drop_after_chunks = None
        self.unhealthy = False

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


_ALIASES = {"error": "error_status", "slow": "slow_factor", "drop": "drop_after_chunks"}


def _set_field(faults: Faults, key: str, value: Any) -> None:
    name = _ALIASES.get(key, key)
    if name == "error_status":
        if value is not None and (_not_int(value) or value not in ERROR_STATUSES):
            raise ValueError(f"'{key}' must be one of {list(ERROR_STATUSES)} or null")
    elif name == "drop_after_chunks":
        if value is not None and (_not_int(value) or value < 0):
            raise ValueError(f"'{key}' must be an integer >= 0 or null")
    elif name == "slow_factor":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise ValueError(f"'{key}' must be a number > 0")
        value = float(value)
    elif name in ("hang", "unhealthy"):
        if not isinstance(value, bool):
            raise ValueError(f"'{key}' must be true or false")
    else:
        raise ValueError(f"unknown fault '{key}'; known: {[*_ALIASES, 'hang', 'unhealthy']}")
    setattr(faults, name, value)


def _not_int(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


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
        elif kind == "slow":
            change = {"slow": float(arg)}
        else:
            change = {kind: int(arg)}
    except ValueError:
        raise ValueError(grammar) from None
    Faults().update(change)  # validates the value
    return index, change
