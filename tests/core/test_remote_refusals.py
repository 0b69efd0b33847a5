"""Write-backs skip the remote store a while after refusals: all tenants' when the store
refused values, one tenant's when its share did (``kvstore.remote_refusals``)."""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.blocks import Namespace
from kvstore.errors import KVStoreError
from kvstore.keys import chain_keys
from kvstore.remote_refusals import Refusals
from kvstore.store import BlockStore, Reservation


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


def _written_back_store(steps: tuple[str, ...]) -> tuple[BlockStore, Namespace, list[bytes]]:
    """A full DRAM of alice's leaves that nothing below holds, in the remote store's
    write-back mode, alice's share refusing lately; pressure makes room by ``steps``."""
    ident = make_identity(tenant="alice")
    store = BlockStore(4 * ident.block_bytes, 4 * ident.block_bytes)
    store.remote_tier = True
    store.remote_write_back = lambda: True
    store.remote_skipping = lambda: frozenset({"alice"})
    store.pressure = steps  # type: ignore[assignment]
    ns = store.open_namespace(ident)
    keys = [chain_keys(ns.id, [i] * ident.block_tokens, ident.block_tokens)[0]
            for i in range(5)]
    for i, key in enumerate(keys[:4]):
        r = store.reserve(f"o{i}", ns, [key], None, 0.0)
        assert isinstance(r, Reservation)
        store.commit(f"o{i}", r.id, 0.0)
    return store, ns, keys


def test_a_skipped_tenants_leaf_is_lossy_to_a_demote_step() -> None:
    """Its leaf would leave unwritten (``_Leaving.evict``): a step that takes only what
    is written below first (demote) leaves it in DRAM, nothing lost."""
    store, ns, keys = _written_back_store(("demote", "reject"))
    with pytest.raises(KVStoreError):
        store.reserve("o", ns, keys[4:], None, 0.0)
    assert all(ns.blocks[k].offset is not None for k in keys[:4])
    store.check_invariants()


def test_a_skipped_tenants_leaf_leaves_as_without_a_remote_store() -> None:
    """An evict step takes it, as it would with no remote store below."""
    store, ns, keys = _written_back_store(("evict", "reject"))
    r = store.reserve("o", ns, keys[4:], None, 0.0)
    assert isinstance(r, Reservation)
    assert sum(ns.blocks.get(k) is not None for k in keys[:4]) == 3
    store.check_invariants()
