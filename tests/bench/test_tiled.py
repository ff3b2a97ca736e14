"""Tiled synthetic workloads (``--workload-arg tile=N``): disjoint copies of one shape."""

from __future__ import annotations

from itertools import islice

import pytest

from kvroute.bench.spec import count_tokens
from kvroute.bench.workloads import SYNTHETIC, make_workload


def _copy(request_id: str) -> int:
    return int(request_id.rpartition("~")[2]) if "~" in request_id else 0


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_copies_share_no_prefix_keep_lengths_and_copy_zero_is_the_workload(name: str) -> None:
    tiled = make_workload(name, seed=3, overrides={"tile": "3"})
    sessions = list(islice(tiled.sessions(), 30))
    specs = [s for session in sessions for s in session]
    assert [_copy(s[0].request_id) for s in sessions] == [0, 1, 2] * 10  # one by one
    heads: dict[str, set[int]] = {}
    for spec in specs:
        assert count_tokens(spec.prompt_text()) == spec.num_prompt_tokens
        heads.setdefault(spec.prompt_text()[:64], set()).add(_copy(spec.request_id))
        copy = _copy(spec.request_id)
        assert copy == 0 or spec.prefix_group.startswith(f"{copy}~")
    assert all(len(copies) == 1 for copies in heads.values())  # no first block in common
    assert len({s.request_id for s in specs}) == len(specs)
    plain = make_workload(name, seed=3)
    own = [s.to_json() for s in islice(plain.sessions(), 10) for s in s]
    assert [s.to_json() for s in sessions[::3] for s in s] == own
    again = make_workload(name, seed=3, overrides={"tile": "3"})
    assert [s.to_json() for s in islice(again.requests(), 40)] == [
        s.to_json() for s in islice(tiled.requests(), 40)
    ]


def test_the_load_defaults_grow_with_the_copies() -> None:
    one, four = make_workload("zipf-hot"), make_workload("zipf-hot", overrides={"tile": "4"})
    assert four.defaults.rates == tuple(4 * r for r in one.defaults.rates)
    assert four.defaults.num_users == 4 * one.defaults.num_users
    assert four.describe()["tile"] == 4 and four.name == "zipf-hot"


@pytest.mark.parametrize("bad", ["0", "x", "-2"])
def test_a_bad_tile_names_the_parameter(bad: str) -> None:
    with pytest.raises(ValueError, match="'tile'"):
        make_workload("gsp", overrides={"tile": bad})
