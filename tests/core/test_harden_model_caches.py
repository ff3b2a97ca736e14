"""The Fleet caches per-model answers only for models some backend lists (issue 9,
finding 5): client-chosen names must not grow it.
"""

from __future__ import annotations

from kvroute.core.fleet import Fleet
from kvroute.core.policy.base import Decision
from tests.core.routing_helpers import chain, make_fleet, req


def _cache_sizes(fleet: Fleet) -> list[int]:
    return [
        len(fleet._served.model_to_eligible),
        len(fleet._served.model_to_block_size),
        len(fleet._served.model_to_key_kind),
    ]


def test_names_no_backend_lists_are_not_cached() -> None:
    """With one backend's model list unknown, any name may be served; 2,000 names once
    added 2,000 entries to each per-model cache (197 MB with 100 KB names)."""
    fleet = make_fleet("least_load", n=0)
    fleet.add_backend("http://listed", models=("m",))
    fleet.add_backend("http://unlisted")  # models unknown: serves any name
    for i in range(2_000):
        name = f"name-{i}"
        d = fleet.route(req(f"r{i}", chain((1, 2)), model=name), 0.0)
        assert d is not None and d.backend == "http://unlisted"
        assert fleet.block_size_for(name) == 16
        assert fleet.key_kind_for(name) == "text"
    assert max(_cache_sizes(fleet)) <= 1
    d = fleet.route(req("m", chain((1, 2)), model="m"), 0.0)
    assert d is not None
    assert max(_cache_sizes(fleet)) <= 2  # a listed model is cached as before
    # a name becomes listed: answers change at once (the caches are invalidated)
    fleet.set_models("http://unlisted", ["name-7"])
    assert fleet.route(req("x", chain((1, 2)), model="name-8"), 0.0) is None
    d = fleet.route(req("y", chain((1, 2)), model="name-7"), 0.0)
    assert d is not None and d.backend == "http://unlisted"


def test_a_model_named_like_an_internal_group_is_just_a_name() -> None:
    fleet = make_fleet("least_load", n=0)
    fleet.add_backend("http://listed", models=("m",))
    fleet.add_backend("http://unlisted")
    # load the unlisted one so that least-load would prefer the listed one if allowed
    d = Decision("http://unlisted", "test", 0, ("http://unlisted",))
    t = fleet.dispatch(d, req("busy", chain((1, 2)), max_tokens=1000), 0.0)
    for name in ("\x00all", "\x00wild"):
        d = fleet.route(req("a", chain((1, 2)), model=name), 0.0)
        assert d is not None and d.backend == "http://unlisted", name
        assert "http://listed" not in d.ranked
    fleet.finish(t, 1.0, ok=True)
    fleet.check_invariants()
