"""Typed settings: declared once on a frozen dataclass, read from plain mappings and text.

A settings class (``CostConfig``, ``FleetConfig``, a policy's ``Params``, the router's
sections) declares each field with its type (the annotation), its default and, where it
has one, its range: ``overhead_s: float = param(0.015, ge=0)``. From that one
declaration:

- ``check_ranges(self)``, called from ``__post_init__``, refuses a value out of range;
- ``build(cls, mapping, path)`` makes an instance from a YAML section: an unknown key, a
  wrong type or a value out of range is a ``ConfigError`` naming the full key
  (``fleet.cost.divert_margin_s: expected a number, got 'abc'``);
- ``parse_text(cls, name, text, path)`` reads one field from a flag's text
  (``--policy-arg max_holders=8``);
- ``to_plain(obj)`` turns it back into plain data (``kvroute serve --print-config``).

A class names its own section in ``SECTION`` ("cost"); its ``__post_init__`` errors say
``cost.<field>``, and ``build`` re-roots them at the path it was built under
(``fleet.cost.<field>``). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kvroute.common.yaml_text import number_as_text_hint

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration value; ``key`` is its full dotted path ("fleet.cost.overhead_s")."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # rebuilt from both fields (the message alone is not the constructor's arguments),
        # so the error survives a process pool's pickling instead of breaking the pool
        return ConfigError, (self.key, self.reason)

    def rerooted(self, section: str, path: str) -> ConfigError:
        """The same error with ``section``'s own prefix replaced by ``path``."""
        key = self.key
        if section and (key == section or key.startswith(section + ".")):
            key = path + key[len(section) :]
        elif not section:
            key = join(path, key)
        return ConfigError(key, self.reason)


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number; None: unbounded on that side."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        """Why ``value`` is out of range (NaN always is), or None."""
        ok = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        return None if ok else f"must be {self.describe()}, got {value!r}"

    def describe(self) -> str:
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if lo is not None and hi is not None:
            left, right = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            return f"in {left}{_num(lo)}, {_num(hi)}{right}"
        if lo is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(lo)}"
        return f"{'<=' if self.le is not None else '<'} {_num(hi or 0)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def param(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a default (an immutable value) and an optional range."""
    bounds = Range(ge, gt, le, lt)
    return dataclasses.field(
        default=default, metadata={"range": bounds} if bounds != Range() else {}
    )


def check_ranges(obj: Any, section: str) -> None:
    """ConfigError ``<section>.<field>`` for the first declared range ``obj`` breaks."""
    for f in dataclasses.fields(obj):
        bounds = f.metadata.get("range")
        value = getattr(obj, f.name)
        if bounds is None or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(join(section, f.name), f"expected a number, got {show(value)}")
        why = bounds.violation(value)
        if why is not None:
            raise ConfigError(join(section, f.name), why)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def show(value: object) -> str:
    """A value as an error message quotes it (short)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_key(key: object, known: Sequence[str]) -> str:
    """The reason of an unknown-key error: the closest known key, else the known keys."""
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return (
        f"unknown key; known: {', '.join(known)}" if known else "unknown key; there are none here"
    )


def build(cls: type[T], raw: object, path: str, *, given: Mapping[str, Any] | None = None) -> T:
    """An instance of the settings dataclass ``cls`` from a plain mapping (None: defaults).

    ``given``: fields already built by the caller (they may not appear in ``raw``).
    Every error is a ConfigError naming the full key under ``path``.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping, got {show(raw)}")
    given = given or {}
    hints = _hints(cls)
    known = [n for n in field_names(cls) if n not in given]
    kwargs: dict[str, Any] = dict(given)
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(join(path, str(key)), unknown_key(key, known))
        kwargs[key] = parse_value(hints[key], value, join(path, key))
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and required and f.name not in kwargs:
            raise ConfigError(join(path, f.name), "missing (required)")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.rerooted(getattr(cls, "SECTION", ""), path) from None


def parse_value(tp: Any, value: object, key: str) -> Any:
    """``value`` as the annotation ``tp`` wants it; ConfigError ``key`` when it is not.

    Ints are taken for floats (YAML writes 1 for 1.0), never bools for numbers; types
    this does not know (IP networks, unions of two types) pass through unchecked.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return parse_value(rest[0], value, key) if len(rest) == 1 else value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return value if isinstance(value, tp) else build(tp, value, key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            names = ", ".join(str(m.value) for m in tp)
            raise ConfigError(key, f"expected one of {names}, got {show(value)}") from None
    if tp in _SCALARS:
        ok, name = _SCALARS[tp]
        if not ok(value):
            hint = number_as_text_hint(value) if tp in (int, float) else ""
            raise ConfigError(key, f"expected {name}, got {show(value)}{hint}")
        return float(value) if tp is float else value  # type: ignore[arg-type]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {show(value)}")
        return tuple(parse_value(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {show(value)}")
        return {
            parse_value(args[0], k, key): parse_value(args[1], v, join(key, str(k)))
            for k, v in value.items()
        }
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_SCALARS: dict[Any, tuple[typing.Callable[[object], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (_is_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_text(cls: type, name: str, text: str, path: str) -> Any:
    """Field ``name`` of ``cls`` from a flag's text ("8", "0.5", "1e-5", "true", "exact");
    ConfigError ``path.name`` for an unknown field or text of the wrong type."""
    known = field_names(cls)
    if name not in known:
        raise ConfigError(join(path, name), unknown_key(name, known))
    tp = _hints(cls)[name]
    return parse_value(tp, _from_text(tp, text.strip()), join(path, name))


def _from_text(tp: Any, text: str) -> object:
    """``text`` converted to the scalar type ``tp`` names, when it reads as one; else the
    text itself (so that ``parse_value`` reports the wrong type)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if text.lower() in ("null", "none", "~") and type(None) in typing.get_args(tp):
            return None
        tp = args[0] if len(args) == 1 else tp
    if tp is bool:
        lowered = text.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else text
    for kind in (int, float):
        if tp is kind:
            try:
                return kind(text)
            except ValueError:
                return text
    return text


def to_plain(obj: object) -> Any:
    """Plain data (dicts, lists, str, numbers, bools, None) from settings: dataclasses by
    field, enums by value, tuples as lists, anything else as its ``str``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)
