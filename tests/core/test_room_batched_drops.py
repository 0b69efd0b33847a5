"""The DRAM copies a request evicts, and those a demotion's write ends, are dropped in a
batch (entries forgotten per victim, slots, tenants' bytes and counts once at the end):
the store ends exactly as block by block, parents that become childless leaves go in the
same pass, and an exception part-way leaves no half-counted state."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore import room
from kvstore.identity import Identity
from kvstore.plans import Plan
from kvstore.blocks import DRAM, SSD
from kvstore.store import BlockStore, Reservation
from kvstore.tier_changes import Removed, Stored, TierChanges

SLOT = 4096
CHAIN = 16


def _identity(model: str = "m", tenant: str = "a") -> Identity:
    return Identity(model=model, model_revision="r", tenant=tenant, kv_dtype="float16",
                    num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=64)


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _commit(store: BlockStore, ns: Any, keys: list[bytes], now: float) -> None:
    r = store.reserve("w", ns, keys, None, now)
    assert isinstance(r, Reservation), r
    store.commit("w", r.id, now)


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_a_batched_eviction_takes_whole_chains_and_counts_exactly(policy: str) -> None:
    store = BlockStore(64 * SLOT, 64 * SLOT, eviction_policy=policy)
    old = store.open_namespace(_identity("old"))
    for tag in range(4):  # four chains of 16 fill the tier
        _commit(store, old, _keys(tag, CHAIN), float(tag))
    store.close_namespace(old)  # no session has it: it goes with its last entry
    assert len(store.roots) == 4 and store.committed_slots == 64
    new = store.open_namespace(_identity("new"))
    before = store.counters.evictions

    r = store.reserve("w", new, _keys(9, 64), None, 10.0)  # every old block must go

    assert isinstance(r, Reservation)
    assert store.counters.evictions - before == 64
    assert store.counters.dropped_on_eviction == 64
    assert not old.blocks, "parents left after their children went"
    assert old.forgotten and old.id not in store.namespaces
    assert not store.roots
    assert store.committed_slots == 0 and store.committed_bytes == 0
    assert old.dram.used == {"a": 64 * SLOT}  # the reservation's slots only
    store.check_invariants()
    store.commit("w", r.id, 10.0)
    assert store.committed_slots == 64
    store.check_invariants()


def test_a_batched_eviction_keeps_what_a_pin_holds_and_its_prefix() -> None:
    store = BlockStore(32 * SLOT, 32 * SLOT, eviction_policy="lru")
    ns = store.open_namespace(_identity())
    _commit(store, ns, _keys(1, CHAIN), 0.0)
    _commit(store, ns, _keys(2, CHAIN), 1.0)
    pinned = store.acquire("r", ns, _keys(1, 4), 2.0)  # a prefix of the older chain
    assert pinned is not None

    r = store.reserve("w", ns, _keys(3, 28), None, 3.0)

    assert isinstance(r, Reservation)
    kept = set(_keys(1, 4))
    assert set(ns.blocks) == kept, "the batch took a pinned block or left a victim's entry"
    assert all(ns.blocks[k].kids is None for k in _keys(1, 4)[3:])
    assert store.committed_slots == 4
    store.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_an_exception_part_way_leaves_the_victims_so_far_counted(policy: str,
                                                                 monkeypatch: Any) -> None:
    store = BlockStore(64 * SLOT, 64 * SLOT, eviction_policy=policy)
    ns = store.open_namespace(_identity())
    for tag in range(4):
        _commit(store, ns, _keys(tag, CHAIN), float(tag))
    evict = room._Leaving.evict
    calls = [0]

    def failing(self: Any, victim: Any) -> None:
        evict(self, victim)
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("a take failed")

    monkeypatch.setattr(room._Leaving, "evict", failing)
    with pytest.raises(RuntimeError):
        store.reserve("w", ns, _keys(9, 8), None, 10.0)
    monkeypatch.setattr(room._Leaving, "evict", evict)

    assert store.counters.evictions == 5 and store.counters.dropped_on_eviction == 5
    assert len(ns.blocks) == 59 and store.committed_slots == 59
    assert ns.dram.used == {"a": 59 * SLOT}
    assert ns.dram.pool.available(ns.cls) == 5
    store.check_invariants()
    _commit(store, ns, _keys(9, 8), 11.0)  # evicts as before: three more
    assert store.committed_slots == 64 and store.counters.evictions == 8
    store.check_invariants()


def _dirty_store(changes: TierChanges | None = None) -> tuple[BlockStore, Any, Plan]:
    """A full tier of blocks admitted to SSD, and the plan to demote 16 of them."""
    store = BlockStore(64 * SLOT, 64 * SLOT, eviction_policy="lru",
                       ssd_capacity=256 * SLOT, ssd_slab_bytes=64 * SLOT, ssd_admit_after=1)
    if changes is not None:
        store.record_changes(changes)
    ns = store.open_namespace(_identity())
    for tag in range(4):
        _commit(store, ns, _keys(tag, CHAIN), float(tag))
    plan = store.reserve("w", ns, _keys(9, CHAIN), None, 10.0)
    assert isinstance(plan, Plan) and len(plan.demote) == CHAIN
    return store, ns, plan


def test_a_written_demotion_drops_its_dram_copies_in_one_batch() -> None:
    store, ns, plan = _dirty_store()
    t, _ = store.ssd_copies.reserve(list(plan.demote))
    free_before = ns.dram.pool.available(ns.cls)

    store.ssd_copies.finish_write(t, [None] * len(t.blocks))

    assert all(b.offset is None and b.ssd_offset is not None and not b.demoting
               for b in plan.demote)
    assert ns.dram.pool.available(ns.cls) == free_before + CHAIN
    assert store.committed_slots == 64 - CHAIN and ns.dram.used == {"a": (64 - CHAIN) * SLOT}
    assert store.ssd_committed_slots == CHAIN and store.counters.demotions == CHAIN
    assert not any(b in store.dirty.get(ns.cls, {}) for b in plan.demote)
    store.check_invariants()
    _commit(store, ns, _keys(9, CHAIN), 11.0)
    store.check_invariants()


def test_a_written_demotion_keeps_what_was_pinned_meanwhile_and_mixed_writes() -> None:
    store, ns, plan = _dirty_store()
    demoted = list(plan.demote)
    through = [ns.blocks[k] for k in _keys(3, 2)]  # the newest: written through alongside
    t, _ = store.ssd_copies.reserve(demoted[:8] + through + demoted[8:])
    store.pin_block(demoted[5])  # a reader pinned it while it was written

    store.ssd_copies.finish_write(t, [None] * len(t.blocks))

    assert demoted[5].offset is not None and not demoted[5].demoting  # stays in DRAM
    assert all(b.offset is None for i, b in enumerate(demoted) if i != 5)
    assert all(b.offset is not None and b.ssd_offset is not None for b in through)
    assert store.committed_slots == 64 - CHAIN + 1
    store.unpin_block(demoted[5])
    store.check_invariants()


def test_a_failed_demotion_puts_every_block_back() -> None:
    store, ns, plan = _dirty_store()
    t, _ = store.ssd_copies.reserve(list(plan.demote))

    store.ssd_copies.finish_write(t, None)

    assert all(b.offset is not None and b.ssd_offset is None and not b.demoting
               for b in plan.demote)
    assert store.committed_slots == 64 and store.ssd_committed_slots == 0
    assert set(plan.demote) <= set(ns.dram.policy(ns.cls).evictable())
    store.check_invariants()


def test_a_written_demotion_announces_each_block_once_per_tier() -> None:
    changes = TierChanges()
    store, ns, plan = _dirty_store(changes)
    changes.drain()  # (what came before: the commits)
    t, _ = store.ssd_copies.reserve(list(plan.demote))

    store.ssd_copies.finish_write(t, [None] * len(t.blocks))

    events = changes.drain()
    keys = sorted(b.key for b in plan.demote)
    assert [(e.tier, sorted(e.keys)) for e in events if isinstance(e, Removed)] == [
        (DRAM, keys)]
    stored = [e for e in events if isinstance(e, Stored)]
    assert {e.tier for e in stored} == {SSD}
    assert sorted(b.key for e in stored for b in e.blocks) == keys  # each once
    assert changes.drain() == []
