"""A request's eviction that fails part-way (an exception out of a victim's take)
leaves no victim stranded: those marked for a write that will never be planned go back
on their eviction orders, evictable again, and the store's invariants hold."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore import room
from kvstore.identity import Identity
from kvstore.plans import Plan
from kvstore.store import BlockStore, Reservation

SLOT = 4096


def _identity() -> Identity:
    return Identity(model="m", model_revision="r", tenant="a", kv_dtype="float16",
                    num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=64)


@pytest.mark.parametrize("quota", [0, 64 * SLOT], ids=["shared", "quota"])
@pytest.mark.parametrize("policy", ["lru", "auto", "s3fifo"])
def test_victims_marked_for_writes_go_back_when_a_take_fails(policy: str, quota: int,
                                                             monkeypatch: Any) -> None:
    store = BlockStore(64 * SLOT, 64 * SLOT, eviction_policy=policy, tenant_quota=quota,
                       ssd_capacity=256 * SLOT, ssd_slab_bytes=64 * SLOT, ssd_admit_after=1)
    ns = store.open_namespace(_identity())
    keys = [bytes([i]) * 16 for i in range(64)]
    r = store.reserve("w", ns, keys, None, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)  # the tier full; each block admitted to SSD: dirty

    evict = room._Leaving.evict
    calls = [0]

    def failing(self: Any, victim: Any) -> None:
        evict(self, victim)
        calls[0] += 1
        if calls[0] == 4:  # (after the victim is marked: what failed came after it)
            raise RuntimeError("a take failed")

    monkeypatch.setattr(room._Leaving, "evict", failing)
    with pytest.raises(RuntimeError):
        store.reserve("w", ns, [bytes([200 + i]) * 16 for i in range(8)], None, 1.0)
    monkeypatch.setattr(room._Leaving, "evict", evict)

    blocks = [ns.blocks[k] for k in keys]
    assert not any(b.demoting for b in blocks), "victims left marked for a write"
    assert not store.remote_demoting
    evictable = set(ns.dram.policy(ns.cls).evictable())
    assert evictable == set(blocks), "victims left off their eviction order"
    store.check_invariants()
    plan = store.reserve("w", ns, [bytes([200 + i]) * 16 for i in range(8)], None, 1.0)
    assert isinstance(plan, Plan) and len(plan.demote) == 8  # evictable as before
