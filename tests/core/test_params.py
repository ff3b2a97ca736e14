"""Declared settings (core/params.py): one declaration gives the type check, the range
check and the error that names the full key; the core's settings use it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from kvroute.core.config import FleetConfig, KeyKind, Mode
from kvroute.core.cost import CostConfig
from kvroute.core.params import (
    ConfigError,
    build,
    check_ranges,
    param,
    parse_text,
    to_plain,
)
from kvroute.core.policy import Reason, default_params, make_policy, policy_class


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Inner:
    SECTION: ClassVar[str] = "inner"

    share: float = param(0.5, ge=0, le=1)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class Outer:
    SECTION: ClassVar[str] = "outer"

    count: int = param(3, ge=1)
    ratio: float = param(1.0, gt=0)
    on: bool = True
    color: Color = Color.RED
    names: tuple[str, ...] = ()
    limit: int | None = None
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


def test_build_takes_a_mapping_of_the_declared_types() -> None:
    raw = {"count": 2, "ratio": 3, "on": False, "color": "blue", "names": ["a"], "limit": 9}
    got = build(Outer, {**raw, "inner": {"share": 1}}, "x")
    assert got == Outer(2, 3.0, False, Color.BLUE, ("a",), 9, Inner(1.0))
    assert isinstance(got.ratio, float) and got.color is Color.BLUE
    assert build(Outer, None, "x") == Outer()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"count": "abc"}, "x.count: expected an integer, got 'abc'"),
        ({"count": True}, "x.count: expected an integer, got True"),
        ({"ratio": "abc"}, "x.ratio: expected a number, got 'abc'"),
        ({"on": 1}, "x.on: expected true or false, got 1"),
        ({"color": "green"}, "x.color: expected one of red, blue, got 'green'"),
        ({"names": "a"}, "x.names: expected a list, got 'a'"),
        ({"names": ["a", 1]}, "x.names[1]: expected a string, got 1"),
        ({"cuont": 1}, "x.cuont: unknown key; did you mean 'count'?"),
        ({"zzz": 1}, "x.zzz: unknown key; known: count, ratio, on, color, names, limit, inner"),
        ({"count": 0}, "x.count: must be >= 1, got 0"),
        ({"ratio": float("nan")}, "x.ratio: must be > 0, got nan"),
        ({"inner": {"share": 2}}, "x.inner.share: must be in [0, 1], got 2.0"),
        ({"inner": {"share": "half"}}, "x.inner.share: expected a number, got 'half'"),
        ({"inner": [1]}, "x.inner: expected a mapping, got [1]"),
    ],
)
def test_a_bad_entry_is_a_config_error_naming_its_full_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(Outer, raw, "x")
    assert str(err.value) == message


def test_text_values_are_read_as_the_field_declares() -> None:
    assert parse_text(Outer, "count", "8", "p") == 8
    assert parse_text(Outer, "ratio", "1e-5", "p") == 1e-5
    assert parse_text(Outer, "on", "false", "p") is False
    assert parse_text(Outer, "color", "blue", "p") is Color.BLUE
    assert parse_text(Outer, "limit", "none", "p") is None
    assert parse_text(Outer, "limit", "4", "p") == 4
    with pytest.raises(ConfigError, match=r"^p\.count: expected an integer, got 'many'$"):
        parse_text(Outer, "count", "many", "p")
    with pytest.raises(ConfigError, match=r"^p\.nope: unknown key"):
        parse_text(Outer, "nope", "1", "p")


def test_to_plain_gives_back_what_build_takes() -> None:
    value = Outer(2, 3.0, False, Color.BLUE, ("a",), None, Inner(0.25))
    plain = to_plain(value)
    assert plain["color"] == "blue" and type(plain["color"]) is str
    assert plain["names"] == ["a"] and plain["inner"] == {"share": 0.25}
    assert build(Outer, plain, "x") == value


def test_the_core_settings_name_their_full_key_when_nested() -> None:
    with pytest.raises(ConfigError) as err:
        build(FleetConfig, {"cost": {"divert_margin_s": "abc"}}, "fleet")
    assert str(err.value) == "fleet.cost.divert_margin_s: expected a number, got 'abc'"
    with pytest.raises(ConfigError, match=r"^fleet\.cost\.rate_step: must be in \(0, 1\]"):
        build(FleetConfig, {"cost": {"rate_step": 2}}, "fleet")
    with pytest.raises(ConfigError, match=r"^fleet\.cost\.prior_prefill_tokens_per_s: must lie"):
        build(FleetConfig, {"cost": {"prior_prefill_tokens_per_s": 100}}, "fleet")
    with pytest.raises(ConfigError, match=r"^fleet\.max_index_entries: must be >= 0"):
        build(FleetConfig, {"max_index_entries": -1}, "fleet")
    fleet = build(FleetConfig, {"max_index_entries": 5, "cost": {"overhead_s": 0}}, "fleet")
    assert (fleet.max_index_entries, fleet.cost.overhead_s) == (5, 0.0)


def test_enums_are_their_strings() -> None:
    for enum_cls in (Mode, KeyKind, Reason):
        for member in enum_cls:
            assert member == member.value and f"{member}" == member.value
            assert enum_cls(member.value) is member
    assert FleetConfig(mode="exact").mode is Mode.EXACT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^fleet\.mode: expected one of approximate, exact"):
        FleetConfig(mode="precise")  # type: ignore[arg-type]


def test_each_policy_parses_its_own_parameters() -> None:
    assert set(default_params()) == {
        "round_robin", "random", "least_load", "power_of_two", "consistent_hash", "prefix",
        "sglang-cache-aware", "dynamo", "aibrix-dualmap",
        "llm-d", "llm-d-no-hit-lru", "chwbl",
    }  # fmt: skip
    params = policy_class("prefix").parse_params({"max_holders": 8}, "policies.prefix")
    policy = make_policy("prefix", params)
    assert (policy.max_holders, policy.num_least_loaded) == (8, 3)  # type: ignore[attr-defined]
    assert make_policy("prefix", max_holders=2).max_holders == 2  # type: ignore[attr-defined]
    assert make_policy("consistent_hash", {"epsilon": 0.5}).epsilon == 0.5  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"^policies\.prefix\.max_holders: must be >= 1"):
        make_policy("prefix", max_holders=0)
    with pytest.raises(ConfigError, match=r"^policies\.round_robin\.x: unknown key; there are"):
        make_policy("round_robin", {"x": 1})
    with pytest.raises(ConfigError, match=r"^policy: unknown policy 'fastest'; known: "):
        make_policy("fastest")
    assert CostConfig() == build(CostConfig, {}, "cost")


def test_a_config_error_survives_pickling() -> None:
    """A process pool (scripts/des_table.py --jobs) sends it back to the parent."""
    import pickle

    error = ConfigError("fleet.mode", "set by 'mode', not in fleet")
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), back.key, back.reason, str(back)) == (
        ConfigError,
        error.key,
        error.reason,
        str(error),
    )
