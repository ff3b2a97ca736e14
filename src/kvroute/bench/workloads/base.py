"""What every workload is: a seeded stream of sessions plus the load it is usually run at."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvroute.bench.spec import RequestSpec, Session


@dataclass(frozen=True, slots=True)
class WorkloadDefaults:
    """How the workload's source runs it, used when the caller does not choose a load."""

    mode: str  # "closed" (users), "open" (rate) or "trace" (arrival_s of each spec)
    num_users: int = 16  # closed: concurrent users
    think_time_s: tuple[float, float] = (0.0, 0.0)  # closed: U(a, b) after each session
    rates: tuple[float, ...] = (math.inf,)  # open: requests/s; several values form a ladder
    max_concurrency: int | None = None  # open: cap on requests in flight
    num_requests: int | None = 500  # run length when neither duration nor count is given


class Workload(abc.ABC):
    """A named, seeded, deterministic generator of request sessions.

    Invariant: two instances built with the same parameters and seed yield the same
    sessions, byte for byte (``RequestSpec.to_json``), however far they are iterated.
    Generation is pure (no I/O, no clock, no global random), so the discrete-event
    simulator can drive it as well as the HTTP load generator.
    """

    name: ClassVar[str]
    defaults: ClassVar[WorkloadDefaults]

    def __init__(self, params: Any, seed: int = 0) -> None:
        self.params = params
        self.seed = seed

    @abc.abstractmethod
    def sessions(self) -> Iterator[Session]:
        """All sessions in order; infinite unless the source is finite (a trace)."""

    def requests(self) -> Iterator[RequestSpec]:
        """The sessions flattened: every turn in session order."""
        for session in self.sessions():
            yield from session

    def describe(self) -> dict[str, Any]:
        """What result.json records under ``workload``."""
        return {"name": self.name, "seed": self.seed, "params": dataclasses.asdict(self.params)}


def _convert(text: str, default: Any, field_name: str) -> Any:
    """Parse one ``key=value`` override to the type of the field's default."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            kind = type(default[0]) if default else float
            return tuple(kind(part) for part in text.split(",") if part)
        if default is None:
            return float(text) if "." in text else int(text)
        return text
    except ValueError:
        raise ValueError(f"bad value {text!r} for workload parameter {field_name!r}") from None


def apply_overrides(params: Any, overrides: Mapping[str, str]) -> Any:
    """``params`` with string overrides (from ``--workload-arg k=v``) converted and applied."""
    fields = {f.name: f for f in dataclasses.fields(params)}
    changes = {}
    for key, text in overrides.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValueError(f"unknown parameter {key!r}; known: {sorted(fields)}")
        changes[name] = _convert(text, getattr(params, name), name)
    return dataclasses.replace(params, **changes)


def check_positive(params: Any, *names: str) -> None:
    """Raise ValueError naming the first of ``names`` that is not > 0."""
    for name in names:
        value = getattr(params, name)
        if not value > 0:
            raise ValueError(f"{type(params).__name__}.{name} must be > 0, got {value}")
