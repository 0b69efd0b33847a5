"""What the write-back flush on a clean stop writes to the SSD tier, and what it may give
up there for it: the blocks only DRAM holds (a restart finds nothing else of them), in
place of the tier's free room, its coldest leaves of the same size (``flush_victim``),
or slabs another size hands over (``slab_moves.StopTrades``).  Pure planning; the
pipeline (``Moves.flush_to_ssd``) writes the plan a batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.blocks import Block, parents_first
from kvstore.core import StoreCore
from kvstore.pool import SlabClass
from kvstore.slab_moves import StopTrades
from kvstore.ssd_copies import tenant_bytes

if TYPE_CHECKING:
    from kvstore.ssd_copies import SsdCopies


# The flush plans from counts (slots free, copies it may trade, slabs a size may take):
# where they were wrong for one size (copies counted as room that it could not trade, a
# slab taken by the other size and half left empty), its blocks stayed unplanned while
# the tier kept room: 9.6 MiB only DRAM held, 7.1 MiB back, 960 KiB of slots free.  So
# the flush plans again from what the tier holds then, while a pass writes some: 7.4 to
# 7.9 MiB back became 7.9 to 8.0.  Those passes write into free room and in place of
# leaves of the same size only, a copy for a block: a slab traded between sizes drops
# what it held (21 copies of 32 KiB for 25 blocks of 16 KiB, once), and may lose bytes.
FLUSH_PASSES = 3


def flush_plan(copies: SsdCopies) -> list[Block]:
    """On the way out, under write-back: the blocks whose one copy is in DRAM, for the
    SSD tier (a restart finds them there), parents first, so that what is written is
    whole prefixes; first those that copies on SSD hang from (a parent only DRAM held,
    its children demoted: without it a restart drops them all), then the rest.  As many
    as each class has slots, its own and the empty slabs (which every class draws on,
    counted once): the flush writes them where there is room, or in place of the SSD
    tier's coldest leaves (``flush_victim``).  A class out of both takes slabs of the
    class with most, as far as ``StopTrades`` lets it (each gives at most half): its
    blocks come first in the plan, so that the slabs it takes are emptied before the
    flush writes blocks of the giving size into them.  A block whose parent stays off
    the SSD tier is not written (a restart drops it)."""
    store = copies.store
    ssd = store.ssd
    assert ssd is not None, "no SSD tier"
    room = [ssd.pool.empty_slabs]  # the empty slabs, shared
    # a class (by its slot size) -> its slots not yet planned: the free ones and those of
    # the copies that may go for the flush's blocks (``open_slots``)
    free = open_slots(store)
    classes = list(ssd.pool.classes.values())
    slabs = {c.slot_bytes: len(c.slabs) for c in classes}  # each class's, as planned
    spare = StopTrades.spare_of(ssd.pool)
    takers: set[int] = set()  # the classes planned to take another's slab
    plan: list[Block] = []
    chosen: set[Block] = set()

    def taken_slab(cls: SlabClass) -> bool:
        """A slab of the class with most, for ``cls`` (``empty_ssd_slab``'s choice)."""
        donors = [c for c in classes if c is not cls and spare.get(c.slot_bytes, 0) > 0]
        if not donors:
            return False
        donor = max(donors, key=lambda c: slabs[c.slot_bytes])
        slabs[donor.slot_bytes] -= 1
        spare[donor.slot_bytes] -= 1
        free[donor.slot_bytes] = max(0, free.get(donor.slot_bytes, 0)
                                     - donor.slots_per_slab)
        takers.add(cls.slot_bytes)
        return True

    def take(blocks: list[Block], cls: SlabClass) -> None:
        for b in copies.write_through_candidates(blocks):
            have = free.setdefault(cls.slot_bytes, 0)
            if have == 0:
                if room[0] > 0:
                    room[0] -= 1  # a slab this class takes: no other class has it
                elif not taken_slab(cls):
                    return
                slabs[cls.slot_bytes] = slabs.get(cls.slot_bytes, 0) + 1
                have = cls.slots_per_slab
            parent = b.parent
            if parent is None or parent.ssd_offset is not None or parent in chosen:
                plan.append(b)
                chosen.add(b)
                have -= 1
            free[cls.slot_bytes] = have

    rest: list[tuple[list[Block], SlabClass]] = []
    for ns in list(store.namespaces.values()):  # every namespace's rescues first
        cls = ns.ssd_cls
        if cls is None:
            continue
        order = parents_first(ns)
        above: set[Block] = set()  # the ancestors of copies on SSD
        for b in reversed(order):
            if (b.ssd_offset is not None or b in above) and b.parent is not None:
                above.add(b.parent)
        take([b for b in order if b in above], cls)
        rest.append(([b for b in order if b not in above], cls))
    for blocks, cls in rest:
        take(blocks, cls)
    # (stable: each namespace's blocks keep their order, parents first)
    plan.sort(key=lambda b: b.ns.ssd_cls is None or b.ns.ssd_cls.slot_bytes not in takers)
    return plan


def open_slots(store: StoreCore) -> dict[int, int]:
    """Per SSD class (by slot size), the slots the flush may plan blocks into: the free
    ones, and those of copies that are no parent of a block only DRAM holds.  Such a
    parent can never become a leaf the flush trades (its child stays in the index), so
    its slot is no room: counted as room, a class full of them planned its blocks there,
    wrote none, and its planned blocks kept another size from the class's slabs
    (``StopTrades`` gives none that holds a parent of one), so neither size was written."""
    assert store.ssd is not None, "no SSD tier"
    free = {c.slot_bytes: c.free_slots for c in store.ssd.pool.classes.values()}
    for ns in store.namespaces.values():
        cls = ns.ssd_cls
        if cls is None:
            continue
        above: set[Block] = set()  # the ancestors of blocks only DRAM holds
        for b in ns.blocks.values():
            if b.offset is None or b.ssd_offset is not None:
                continue
            parent = b.parent
            while parent is not None and parent not in above:
                above.add(parent)
                parent = parent.parent
        copies = sum(b.ssd_offset is not None and b not in above for b in ns.blocks.values())
        free[cls.slot_bytes] = free.get(cls.slot_bytes, 0) + copies
    return free


def whole_prefixes(batch: Sequence[Block]) -> list[Block]:
    """The blocks of a flush's batch (parents first) whose parent is on the SSD tier, or
    kept before them here: a block whose parent an earlier batch failed to write would
    be written for nothing (the restart drops it as an orphan)."""
    kept: set[Block] = set()
    for b in batch:
        parent = b.parent
        if parent is None or parent.ssd_offset is not None or parent in kept:
            kept.add(b)
    return [b for b in batch if b in kept]


def unrooted_copies(store: StoreCore) -> list[Block]:
    """The SSD copies a restart would drop as orphans: those below a block the tier
    does not hold (a parent whose copy it let go while DRAM held the block, or that the
    flush found no room for, or ran out of time to write).  Withdrawn on the way out
    (``withdraw_unrooted``), what survives the stop is prefix-closed by construction:
    the restart drops none, and the index keeps no record it would read for nothing."""
    out: list[Block] = []
    for ns in store.namespaces.values():
        if ns.ssd_cls is None:
            continue
        rooted: set[Block] = set()  # on the tier, and every block above it too
        for b in parents_first(ns):
            if b.ssd_offset is None:
                continue
            if b.parent is None or b.parent in rooted:
                rooted.add(b)
            else:
                out.append(b)
    return out


def withdraw_unrooted(store: StoreCore) -> list[tuple[bytes, bytes]]:
    """On the way out, once nothing more is written to the SSD tier: drop the copies
    ``unrooted_copies`` finds; the index records to withdraw before it is synced."""
    return [store.drop_ssd_copy(b) for b in unrooted_copies(store)]


def flush_victim(b: Block, planned: set[Block], givers: set[str]) -> bool:
    """Whether the flush on the way out may trade ``b``'s SSD copy for a block only DRAM
    holds (``reserve`` asks, of copies no transfer holds): a leaf of the index (a
    restart must find every parent of what it keeps), not a block the flush writes, of
    a tenant in ``givers`` (``flush_givers``)."""
    return b.kids is None and b not in planned and b.ns.tenant in givers


def flush_givers(store: StoreCore, batch: Sequence[Block]) -> set[str]:
    """The tenants whose SSD copies the flush of ``batch`` may trade: the batch's own,
    and those over their weighted share of the tier (``TenantOrders``'s rule).  Any
    leaf once went: a tenant with DRAM full on the way out pushed every other's copies
    off the tier, where its demotions while serving take its own first."""
    assert store.ssd is not None, "no SSD tier"
    held, givers = tenant_bytes(store), {b.ns.tenant for b in batch}
    weights = {t: store.tenant_weights.get(t, 1.0) for t in held.keys() | givers}
    share = store.ssd.pool.capacity_bytes / sum(weights.values())
    return givers | {t for t, n in held.items() if n > share * weights[t]}
