"""The store seen from outside: figures per tier, and the invariant checker.

Both walk every block (O(blocks)): stats for tests and the stats verb, the checker for
tests and ``--debug-invariants``.
"""

from __future__ import annotations

from kvstore.blocks import DRAM, SSD, Block
from kvstore.core import StoreCore
from kvstore.pool import SlabClass


# -- inspection -----------------------------------------------------------------------------
def tier_stats(store: StoreCore) -> dict[str, dict[str, int]]:
    c = store.counters
    dram_reserved = sum(len(r.offsets) * r.ns.cls.slot_bytes for s in store.owners.values()
                        for r in s.reservations.values())
    dram_reserved += sum(len(t.offsets) * b.ns.cls.slot_bytes
                         for t in store.transfers.values() if t.tier == DRAM
                         for b in t.blocks[:1])
    dram_committed = sum(ns.cls.slot_bytes for ns in store.namespaces.values()
                         for b in ns.blocks.values() if b.offset is not None)
    dram_blocks = sum(1 for ns in store.namespaces.values() for b in ns.blocks.values()
                      if b.offset is not None)
    pools = [t.pool for t in store.drams.values()]
    capacity = (sum(p.capacity_bytes for p in pools) if store.per_tenant
                else store.dram_args[0])
    out = {DRAM: {
        "capacity": capacity,
        "free": capacity - dram_reserved - dram_committed,
        "reserved": dram_reserved,
        "committed": dram_committed,
        "reserved_slots": store.reserved_slots,
        "committed_slots": store.committed_slots,
        "blocks": dram_blocks,
        "pinned_blocks": sum(1 for ns in store.namespaces.values()
                             for b in ns.blocks.values() if b.refs),
        "tail_waste": sum(p.tail_waste_bytes() for p in pools),
        "empty_slabs": sum(p.empty_slabs for p in pools),
        "arenas": len(pools),
        "hits": c.hit_blocks,
        "lookups": c.lookups,
        "lookup_keys": c.lookup_keys,
        "evictions": c.evictions,
        "commits": c.committed_blocks,
        "duplicates": c.duplicate_blocks,
        "aborts": c.aborts,
        "lease_expiries": c.lease_expiries,
        "capacity_rejects": c.capacity_rejects,
        "peak_committed": c.peak_committed,
        "promotions": c.promotions,
        "dropped_on_eviction": c.dropped_on_eviction,
        "remote_writebacks": c.remote_writebacks,
    }}
    if store.ssd is not None:
        spool = store.ssd.pool
        committed = sum(b.ns.ssd_cls.slot_bytes for ns in store.namespaces.values()
                        for b in ns.blocks.values()
                        if b.ssd_offset is not None and b.ns.ssd_cls is not None)
        reserved = sum(len(t.offsets) * (t.blocks[0].ns.ssd_cls.slot_bytes
                                          if t.blocks and t.blocks[0].ns.ssd_cls else 0)
                       for t in store.transfers.values() if t.tier == SSD)
        out[SSD] = {
            "capacity": spool.capacity_bytes,
            "free": spool.capacity_bytes - reserved - committed,
            "reserved": reserved,
            "committed": committed,
            "reserved_slots": store.ssd_reserved_slots,
            "committed_slots": store.ssd_committed_slots,
            "blocks": store.ssd_committed_slots,
            "pinned_blocks": 0,
            "tail_waste": spool.tail_waste_bytes(),
            "empty_slabs": spool.empty_slabs,
            "evictions": c.ssd_evictions,
            "evicted_unwritten": c.ssd_evicted_unwritten,
            "demotions": c.demotions,
            "writes": c.ssd_writes,
            "checksum_failures": c.checksum_failures,
            "hits": c.ssd_hits,
        }
    if store.gpu is not None:
        out["gpu"] = store.gpu.stats()
    return out

def check_invariants(store: StoreCore) -> None:
    """Conservation per tier and class, one state per slot, closure, pins off orders."""
    for dram in store.drams.values():
        dram.pool.check()
    if store.ssd is not None:
        store.ssd.pool.check()
    reserved: dict[SlabClass, list[int]] = {}
    pin_counts: dict[Block, int] = {}
    for state in store.owners.values():
        for r in state.reservations.values():
            reserved.setdefault(r.ns.cls, []).extend(r.offsets)
            if r.parent is not None and r.parent_pinned:
                pin_counts[r.parent] = pin_counts.get(r.parent, 0) + 1
        for pin in state.pins.values():
            for b in pin.blocks:
                pin_counts[b] = pin_counts.get(b, 0) + 1
    for t in store.transfers.values():
        for b, off in zip(t.blocks, t.offsets):
            cls = b.ns.cls if t.tier == DRAM else b.ns.ssd_cls
            assert cls is not None
            reserved.setdefault(cls, []).append(off)
    for t in store.transfers.values():
        for b, demote in zip(t.blocks, t.demote):
            if t.tier == SSD and not demote:
                pin_counts[b] = pin_counts.get(b, 0) + 1
    if store.gpu is not None:
        for b in store.gpu.copying:  # read into the GPU tier: pinned meanwhile
            pin_counts[b] = pin_counts.get(b, 0) + 1
        store.gpu.check(b for ns in store.namespaces.values() for b in ns.blocks.values())
    used: dict[tuple[int, str], int] = {}  # (tier, tenant): bytes of DRAM slots held
    for state in store.owners.values():
        for r in state.reservations.values():
            at = (id(r.ns.dram), r.ns.tenant)
            used[at] = used.get(at, 0) + len(r.offsets) * r.ns.cls.slot_bytes
    for t in store.transfers.values():
        if t.tier == DRAM:
            for b in t.blocks:
                at = (id(b.ns.dram), b.ns.tenant)
                used[at] = used.get(at, 0) + b.ns.cls.slot_bytes
    committed: dict[SlabClass, list[int]] = {}
    pinned: dict[tuple[int, str], int] = {}
    for ns in store.namespaces.values():
        at = (id(ns.dram), ns.tenant)
        held = sum(1 for b in ns.blocks.values() if b.offset is not None)
        used[at] = used.get(at, 0) + held * ns.cls.slot_bytes
        held_pins = sum(1 for b in ns.blocks.values() if b.refs)
        pinned[at] = pinned.get(at, 0) + held_pins * ns.cls.slot_bytes
    for dram in store.drams.values():
        for tenant, nbytes in dram.pinned.items():
            assert pinned.pop((id(dram), tenant), 0) == nbytes, (
                f"tenant {tenant!r}: {nbytes} bytes counted as pinned, not so")
    uncounted = {at: nbytes for at, nbytes in pinned.items() if nbytes}
    assert not uncounted, f"pins not counted per tenant: {uncounted}"
    for dram in store.drams.values():
        for tenant, nbytes in dram.used.items():
            holds = used.pop((id(dram), tenant), 0)
            assert holds == nbytes, (
                f"tenant {tenant!r} is charged {nbytes} bytes of dram, holds {holds}")
    held_uncharged = {at: nbytes for at, nbytes in used.items() if nbytes}
    assert not held_uncharged, f"dram slots held but not charged: {held_uncharged}"
    for ns in store.namespaces.values():
        child_counts: dict[Block, int] = {}
        for key, b in ns.blocks.items():
            assert b.key == key and b.ns is ns, f"{b} indexed under the wrong key"
            if b.offset is not None:
                committed.setdefault(ns.cls, []).append(b.offset)
            if b.ssd_offset is not None:
                assert ns.ssd_cls is not None
                committed.setdefault(ns.ssd_cls, []).append(b.ssd_offset)
            if b.parent is not None:
                assert ns.blocks.get(b.parent.key) is b.parent, (
                    f"{b} is cached but its parent is not (prefix closure broken)")
                child_counts[b.parent] = child_counts.get(b.parent, 0) + 1
            if not b.present:
                assert b.children or b.ssd_holds or b.promoting, f"hollow {b} kept for nothing"
            held = pin_counts.get(b, 0)
            assert b.refs == held, f"{b} has refs={b.refs} but {held} pins hold it"
        for b in ns.blocks.values():
            assert b.children == child_counts.get(b, 0), f"{b} child count is off"
    tiers = [(DRAM, t) for t in store.drams.values()]
    tiers += [(SSD, store.ssd)] if store.ssd is not None else []
    for name, tier in tiers:
        for slot_bytes, cls in tier.pool.classes.items():
            free = list(tier.pool.free_offsets(cls))
            res = reserved.get(cls, [])
            com = committed.get(cls, [])
            assert len(free) + len(res) + len(com) == cls.capacity_slots, (
                f"{name} class {slot_bytes}: free {len(free)} + reserved {len(res)} + "
                f"committed {len(com)} != capacity {cls.capacity_slots}")
            every = free + res + com
            assert len(set(every)) == len(every), (
                f"{name} class {slot_bytes}: a slot is in two states")
            policy = tier.policies.get(slot_bytes)
            if policy is None:
                continue
            for b in policy.evictable():
                assert b.ns.blocks.get(b.key) is b, f"{b} on the order but not cached"
                if name == DRAM:
                    assert b.refs == 0, f"pinned {b} is on the eviction order"
                    assert b.offset is not None and not b.demoting, f"{b} on the order"
                else:
                    assert b.ssd_offset is not None, f"{b} on the ssd order without a copy"
            if name == DRAM:
                expected = sum(1 for ns in store.namespaces.values() if ns.cls is cls
                               for b in ns.blocks.values()
                               if b.offset is not None and b.refs == 0 and not b.demoting)
            else:
                expected = sum(1 for ns in store.namespaces.values() if ns.ssd_cls is cls
                               for b in ns.blocks.values() if b.ssd_offset is not None)
            assert len(policy) == expected, (
                f"{name} class {slot_bytes}: {len(policy)} on the eviction order, "
                f"{expected} expected")
    for dirty_cls, dirty in store.dirty.items():
        for b in dirty:
            assert b.ns.blocks.get(b.key) is b and b.offset is not None, f"dirty {b} gone"
            assert b.ssd_offset is None and b.ns.cls is dirty_cls, (
                f"{b} listed dirty but clean")
    ssd_classes = set(store.ssd.pool.classes.values()) if store.ssd is not None else set()
    dram_reserved = sum(len(v) for c, v in reserved.items() if c not in ssd_classes)
    dram_committed = sum(len(v) for c, v in committed.items() if c not in ssd_classes)
    assert dram_reserved == store.reserved_slots, "reserved slot counter is off"
    assert dram_committed == store.committed_slots, "committed slot counter is off"
    ssd_committed = sum(len(v) for c, v in committed.items() if c in ssd_classes)
    assert ssd_committed == store.ssd_committed_slots, "ssd committed counter is off"
