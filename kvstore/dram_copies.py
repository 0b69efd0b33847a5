"""The DRAM tier's copies, through the tier interface: figures and invariants.

DRAM is every block's home: its copies' state (slots per arena and slab class, the
eviction orders, pins, the blocks only DRAM holds) lives in the core, which every part
changes through its primitive moves; this view reads it for the interface.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.blocks import DRAM, Block
from kvstore.core import StoreCore
from kvstore.pool import SlabClass
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.switch import Switch


class DramCopies:
    """The DRAM tier (one arena per tenant, or one for all) as a ``Tier``."""

    name = DRAM

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    def holds(self, block: Block) -> bool:
        return block.offset is not None

    def drop(self, block: Block) -> None:
        self.store.drop_dram_copy_unchecked(block)

    def stats(self) -> dict[str, int]:
        store, c = self.store, self.store.counters
        dram_reserved, dram_committed = store.reserved_bytes, store.committed_bytes
        pools = [t.pool for t in store.drams.values()]
        budget = store.dram_budget  # (per-tenant arenas: capacity is theirs together)
        capacity = store.dram_args[0]
        figures = {
            "capacity": capacity,
            "free": capacity - dram_reserved - dram_committed,
            "reserved": dram_reserved,
            "committed": dram_committed,
            "reserved_slots": store.reserved_slots,
            "committed_slots": store.committed_slots,
            "blocks": store.committed_slots,
            "pinned_blocks": store.pinned_blocks,
            "tail_waste": sum(p.tail_waste_bytes() for p in pools),
            "empty_slabs": (budget.spare if budget is not None
                            else sum(p.empty_slabs for p in pools)),
            "slab_moves": c.slab_moves,
            "slab_moved_blocks": c.slab_moved_blocks,
            "slab_turns": c.slab_turns,
            "arenas": len(pools),
            "hits": c.hit_blocks,
            "lookups": c.lookups,
            "lookup_keys": c.lookup_keys,
            "evictions": c.evictions,
            "commits": c.committed_blocks,
            "duplicates": c.duplicate_blocks,
            "awaited": c.awaited_keys,
            "awaited_dropped": c.awaited_dropped,
            "commits_waited": c.commits_waited,
            "commit_wait_timeouts": c.commit_wait_timeouts,
            "commit_wait_cycles": c.commit_wait_cycles,
            "aborts": c.aborts,
            "lease_expiries": c.lease_expiries,
            "capacity_rejects": c.capacity_rejects,
            "peak_committed": c.peak_committed,
            "promotions": c.promotions,
            "dropped_on_eviction": c.dropped_on_eviction,
            "remote_writebacks": c.remote_writebacks,
        }
        if budget is not None:  # slabs the arenas may hold together; one taken for another
            figures["budget_slabs"], figures["budget_taken"] = budget.slabs, budget.taken
            # slabs whose memory the file system did not have (dram.directory full), and
            # requests refused while more arenas wrote than the budget has slabs
            figures["budget_no_memory"] = budget.backing_failed
            figures["budget_held_back"] = budget.held_back
        return figures

    def check(self, blocks: Iterable[Block]) -> None:
        """Per arena and slab class: free + reserved + committed == capacity, one state
        per slot; the eviction orders hold exactly the unpinned, settled copies; the
        list of DRAM-only blocks and the slot counters agree with the blocks."""
        store = self.store
        reserved: dict[SlabClass, list[int]] = {}
        for state in store.owners.values():
            for r in state.reservations.values():
                reserved.setdefault(r.ns.cls, []).extend(r.offsets)
        for t in store.transfers.values():
            if t.tier == DRAM:
                for b, off in zip(t.blocks, t.offsets):
                    reserved.setdefault(b.ns.cls, []).append(off)
        committed: dict[SlabClass, list[int]] = {}
        pinned = 0
        for b in blocks:
            pinned += b.refs > 0
            if b.offset is not None:
                committed.setdefault(b.ns.cls, []).append(b.offset)
                # the slot's holder is known, for a slab handed to another block size
                assert b.ns.dram.pool.holder(b.ns.cls, b.offset) is b, f"{b}: not its slot's"
        for dram in store.drams.values():
            dram.pool.check()
            for slot_bytes, cls in dram.pool.classes.items():
                check_slots(DRAM, dram.pool.free_offsets(cls), reserved.get(cls, []),
                            committed.get(cls, []), cls.capacity_slots, slot_bytes)
                policy = dram.policies.get(slot_bytes)
                if policy is None:
                    continue
                for b in policy.evictable():
                    assert b.ns.blocks.get(b.key) is b, f"{b} on the order but not cached"
                    assert b.refs == 0, f"pinned {b} is on the eviction order"
                    assert b.offset is not None and not b.demoting, f"{b} on the order"
                inner = getattr(policy, "inner", policy)  # (under WarmPins: warm blocks
                # are outside the order it wraps; a change of policy under way holds
                # blocks in both orders)
                duels = [o for o in (inner.parts() if isinstance(inner, Switch) else [inner])
                         if isinstance(o, Duel)]
                duel = bool(duels)
                for d in duels:
                    for b in d.evictable():
                        assert b.dram_duel is not None, f"{b} untracked by the duel"
                expected = 0
                for ns in store.namespaces.values():
                    if ns.cls is not cls:
                        continue
                    for b in ns.blocks.values():
                        if b.offset is None:
                            # the duel's states live in the blocks: only its tracked
                            # blocks have one, none left by a duel let go (a switch)
                            assert b.dram_duel is None, f"{b} tracked without a copy"
                            continue
                        expected += b.refs == 0 and not b.demoting
                        assert duel or b.dram_duel is None, f"{b} keeps a let-go duel's state"
                assert len(policy) == expected, (
                    f"dram class {slot_bytes}: {len(policy)} on the eviction order, "
                    f"{expected} expected")
        for dirty_cls, dirty in store.dirty.items():
            for b in dirty:
                assert b.ns.blocks.get(b.key) is b and b.offset is not None, f"dirty {b} gone"
                assert b.ssd_offset is None and b.ns.cls is dirty_cls, (
                    f"{b} listed dirty but clean")
        assert sum(map(len, reserved.values())) == store.reserved_slots, (
            "reserved slot counter is off")
        assert sum(map(len, committed.values())) == store.committed_slots, (
            "committed slot counter is off")
        assert sum(cls.slot_bytes * len(offs) for cls, offs in reserved.items()) \
            == store.reserved_bytes, "reserved byte counter is off"
        assert sum(cls.slot_bytes * len(offs) for cls, offs in committed.items()) \
            == store.committed_bytes, "committed byte counter is off"
        assert pinned == store.pinned_blocks, (
            f"{store.pinned_blocks} blocks counted as pinned, {pinned} are")

    def __repr__(self) -> str:
        return (f"DramCopies(arenas={len(self.store.drams)}, "
                f"committed={self.store.committed_slots})")


def check_slots(tier: str, free: Iterable[int], reserved: list[int], committed: list[int],
                capacity: int, slot_bytes: int) -> None:
    """One slab class of a tier: every slot in exactly one state, none missing."""
    free = list(free)
    assert len(free) + len(reserved) + len(committed) == capacity, (
        f"{tier} class {slot_bytes}: free {len(free)} + reserved {len(reserved)} + "
        f"committed {len(committed)} != capacity {capacity}")
    every = free + reserved + committed
    assert len(set(every)) == len(every), f"{tier} class {slot_bytes}: a slot is in two states"
