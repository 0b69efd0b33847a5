"""Write-backs skip the remote store a while after refusals: all tenants' when the store
refused values, one tenant's when its share did (``kvstore.remote_refusals``)."""

from __future__ import annotations

from kvstore.remote_refusals import Refusals


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_share_refusal_skips_its_tenant_only_for_the_cooldown() -> None:
    clock = Clock()
    r = Refusals(5.0, clock)
    assert r.refuse("mallory") is True and r.refuse("mallory") is False  # (logged once)
    assert not r.serves("mallory") and r.serves("alice") and r.taking()
    assert r.skipping() == {"mallory"}
    clock.now += 5.0
    assert r.skipping() == frozenset() and r.serves("mallory")
    assert not r.tenants  # an ended cooldown is let go
    assert r.refuse("mallory") is True


def test_a_refusal_of_the_store_skips_every_tenant() -> None:
    clock = Clock()
    r = Refusals(5.0, clock)
    assert r.refuse() is True and r.refuse() is False
    assert not r.taking() and not r.serves("alice") and not r.serves("mallory")
    clock.now += 5.0
    assert r.taking() and r.serves("alice") and r.refuse() is True
