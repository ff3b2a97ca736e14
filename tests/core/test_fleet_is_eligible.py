"""Fleet.is_eligible: what a retry asks of each backend in a ranking made earlier."""

from __future__ import annotations

from tests.core.routing_helpers import make_fleet, url


def test_is_eligible_follows_health_draining_models_and_membership() -> None:
    fleet = make_fleet(n=3)
    fleet.set_models(url(2), ["m1"])
    assert fleet.is_eligible(url(0), "m1") and fleet.is_eligible(url(0), None)
    fleet.set_healthy(url(0), False)
    assert not fleet.is_eligible(url(0), "m1")
    fleet.set_draining(url(1), True)
    assert not fleet.is_eligible(url(1), "m1")
    fleet.set_draining(url(1), False)
    assert fleet.is_eligible(url(1), "m1")
    assert fleet.is_eligible(url(2), "m1") and not fleet.is_eligible(url(2), "m2")
    fleet.remove_backend(url(2))
    assert not fleet.is_eligible(url(2), "m1")
    assert not fleet.is_eligible("http://never-added:1", None)
