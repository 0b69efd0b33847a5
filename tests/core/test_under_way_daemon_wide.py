"""The daemon's work under way in tasks is bounded over every session and tenant: many
tenants' sessions, each under its own limits, together held tasks and keys without
bound.  Past the daemon's bound a request is refused with nothing counted; an evict or a
drop still goes (it gives back the room those waiting hold the bound for)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.config import Config, ServerConfig
from kvstore.errors import ConfigError, LimitExceededError
from kvstore.under_way import UnderWay


def sessions(count: int) -> list[Any]:
    return [SimpleNamespace(id=f"s{i}", tenant=f"t{i}") for i in range(count)]


def test_requests_over_every_tenant_are_bounded() -> None:
    under_way = UnderWay(most_requests=4, most_keys=1000)
    many = sessions(5)
    for s in many[:4]:
        under_way.take(s, 10)
    with pytest.raises(LimitExceededError, match="max_requests_under_way"):
        under_way.take(many[4], 10)
    assert under_way.requests == 4 and under_way.keys == 40  # nothing counted
    assert "s4" not in under_way.sessions and "t4" not in under_way.tenant_keys
    under_way.take(many[4], 10, freeing=True)  # an evict: goes, and counts
    assert under_way.requests == 5
    under_way.check()
    for s in many:
        under_way.give(s, 10)
    assert (under_way.requests, under_way.keys) == (0, 0)
    under_way.take(many[4], 10)  # the count went back
    under_way.check()


def test_keys_over_every_tenant_are_bounded() -> None:
    under_way = UnderWay(most_requests=100, most_keys=25)
    a, b, c = sessions(3)
    under_way.take(a, 10)
    under_way.take(b, 10)
    with pytest.raises(LimitExceededError, match="max_keys_under_way"):
        under_way.take(c, 10)
    under_way.take(c, 0)  # a request of no keys (a whole snapshot) is one more request
    under_way.check()
    assert under_way.keys == 20 and under_way.requests == 3


def test_the_bounds_are_configured_positive() -> None:
    assert ServerConfig().max_requests_under_way >= 256  # a session's worth at least
    for name in ("max_requests_under_way", "max_keys_under_way"):
        with pytest.raises(ConfigError, match=name):
            Config(server=ServerConfig(**{name: 0})).validate()


def test_a_tenant_holds_at_most_its_share_of_the_daemons_bound() -> None:
    under_way = UnderWay(most_requests=12, most_keys=1000, weights={"small": 0.5})
    heavy = [SimpleNamespace(id=f"h{i}", tenant="heavy") for i in range(12)]
    for s in heavy[:6]:  # alone: half of the bound, over as many sessions as it likes
        under_way.take(s, 1)
    with pytest.raises(LimitExceededError, match="tenant 'heavy'.*share"):
        under_way.take(heavy[6], 1)
    assert under_way.tenant_requests == {"heavy": 6} and under_way.requests == 6
    small = [SimpleNamespace(id=f"s{i}", tenant="small") for i in range(12)]
    for s in small[:2]:  # weight 0.5 beside one of weight 1: 0.5 / (1 + 0.5 + 1) of it
        under_way.take(s, 1)
    with pytest.raises(LimitExceededError, match="tenant 'small'"):
        under_way.take(small[2], 1)
    under_way.take(heavy[6], 1, freeing=True)  # an evict is not refused for its share
    newcomer = SimpleNamespace(id="n", tenant="newcomer")
    under_way.take(newcomer, 1)  # a newcomer's first request is never refused for it
    under_way.check()
    for s in (*heavy[:7], *small[:2], newcomer):
        under_way.give(s, 1)
    assert under_way.tenant_requests == {} and under_way.weight_under_way == 0.0
