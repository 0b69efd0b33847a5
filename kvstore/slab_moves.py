"""Slabs handed from one block size's class to another's in a shared DRAM tier.

A tier's slabs serve one slot size each (``kvstore.pool``), and a slab used to go back
to the tier only once every slot of it was free.  So once blocks of one size filled an
arena, a namespace of another size (another model's geometry) was refused until those
slabs emptied by themselves, which under steady traffic they never do; and a size
that got a slab or two early kept evicting within them while another size held the
rest.  As memcached reassigns slabs between its classes, a class takes a slab from
another:

- **when it is starved**: its free and evictable slots cannot hold the request, or
- **when it holds less than its share**: each class's share of the slabs follows its
  share of the bytes the tier's requests used lately (slots granted, and DRAM hits by
  lookup or read), decayed by half each time requests took twice the tier's capacity;
  a class gets one more slab only while that leaves it within its share, and gives one
  only while it keeps its own (one slab of slack each way, so slabs do not go back and
  forth).

A tenant over its weighted share
of the tier takes only a slab all of whose blocks are its own, evicting only its own
(its old model's size gives way to its new one; another tenant's never does).

The donor is the class furthest over its share.  Of its slabs, the one with fewest
used slots whose every slot holds a committed block nothing reads or writes now (no
pin, no reservation, no transfer): its blocks' bytes are copied into free slots of the
class's other slabs, made by evicting the class's own coldest blocks by its own order
(leaves first, written down first where the pressure steps say so: a starved request
then waits for those writes and asks again; one merely under its share makes room
among its own blocks instead), and the empty slab goes to the class asking.  Blocks
keep their entries, orders and copies in other tiers; only their DRAM offset changes,
which no client holds without a pin.  At most the slab's bytes are copied, on the loop,
once per slab moved, a step a turn of the loop (``STEP_BLOCKS``, ``STEP_BYTES``): the
room for a step's blocks made, then the step's blocks copied, the request answered
with a plan of a turn in between, the slab drained meanwhile (none of its slots handed
out, the room made for its blocks held: ``SlabPool.drain``; one slab of a class at a
time, and other starved requests wait their turn), so that each turn holds the loop
for a step, not for a slab (a 64 MiB slab of 16 KiB blocks, 4096 evictions and 2048
copies, held it 7.2-8.2 ms in one go, 1.3-2.3 in steps).  Known waste: the donor's
evictions may free too few slots (its order counts blocks no pressure step may take:
parents of pinned blocks, say), and those it made stay made though no slab moves.

The SSD tier's slabs move only for a size with nothing of its own to evict there
(``empty_ssd_slab``): a slab of the class with most (which keeps one) is emptied by
dropping its copies (the SSD copies of blocks also in DRAM, and the SSD-only blocks with
what hangs below them, never a block being written or in use), the slab with the fewest
SSD-only blocks that others hang below first.  Copying them elsewhere on the disk, and
shares by use there, are not done yet.  Where no SSD slab can be found for a size (an
SSD tier of one slab, another size's), its DRAM blocks leave as if there were no SSD
tier (``ssd_refused``) rather than be planned for writes the tier refuses.  The flush
on a clean stop hands SSD slabs the same way (``StopTrades``), at most half of a size's.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from kvstore.arena_budget import held
from kvstore.blocks import SSD, Block, TierSlots, subtree
from kvstore.errors import CapacityError
from kvstore.plans import Plan
from kvstore.pool import Slab, SlabClass, SlabPool, unbacked

if TYPE_CHECKING:
    from kvstore.core import StoreCore

# Slabs of a donor looked at for one that can be emptied now, fewest used slots first
# (each look walks the slab's slots).
_CANDIDATES = 8
# The most blocks of a slab moved in one turn of the loop (evicted to make room for
# them, then copied), and the most bytes: a 64 MiB slab of 16 KiB blocks emptied in one
# go held the loop 7.2-9.3 ms (4096 evictions and 2048 copies,
# ``benchmarks/slab_move_hold.py``); a bigger slab is emptied a step a turn.
STEP_BLOCKS = 512
STEP_BYTES = 8 << 20


def step_blocks(cls: SlabClass) -> int:
    """How many blocks of ``cls`` a slab's move handles in one turn."""
    return max(1, min(STEP_BLOCKS, STEP_BYTES // cls.slot_bytes))


class SlabMoves:
    """Which class gives a slab to which, and the giving (see the module docstring)."""

    def __init__(self, store: StoreCore, make_room: Callable[..., Plan | None],
                 put_back: Callable[[list[Block]], None]) -> None:
        self.store = store
        self.make_room = make_room  # ``RoomMaker._make_room``: evict within one class
        self.put_back = put_back  # ``RoomMaker._put_back``: victims of a plan let go
        # The slab the last step made room for, and for which tenant (``_resumed``).
        self._checked: tuple[Slab, str | None] | None = None
        # Each per-tenant arena's DRAM demand (slots taken and hits) as last seen: one
        # that changed since was used, if only read (``_note_reads``).
        self._demand_seen: dict[object, float] = {}

    @staticmethod
    def shares_of(dram: TierSlots) -> dict[SlabClass, float]:
        """Each class's share of the tier's slabs now, in slabs (by its recent use)."""
        pool = dram.pool
        classes = [c for c in pool.classes.values() if c.slabs or dram.demand.get(c.slot_bytes)]
        used = {c: dram.demand.get(c.slot_bytes, 0.0) for c in classes}
        total = sum(used.values())
        if not total:
            return {c: len(c.slabs) for c in classes}
        return {c: pool.num_slabs * u / total for c, u in used.items()}

    def make_way(self, dram: TierSlots, cls: SlabClass, count: int,
                 protect: Block | None, tenant: str | None = None) -> Plan | None:
        """Give ``cls`` slabs of other classes while it is starved for ``count`` slots,
        or one while it is under its share (only slabs of ``tenant``'s own blocks, if
        given: a tenant over its share of the tier); a Plan where a donor's writes must
        come first.  Nothing to do (or nothing that can be done now) is None.

        One slab a turn of the loop: a request that needs more is answered with a Plan
        of a turn (``turn``), the slabs emptied for it set aside for its class
        (``SlabPool.earmark``) until it is made again, so that neither the donor's own
        next write nor another size takes them meanwhile.  A slab's move holds the loop
        (its evictions and copies: about 10 ms for a 64 MiB slab of 16 KiB blocks); a
        request of fifteen held it fifteen times as long, every other client waiting."""
        pool = dram.pool
        others = sum(len(c.slabs) for c in pool.classes.values() if c is not cls)
        if pool.available(cls) + len(dram.policy(cls)) + others * cls.slots_per_slab < count:
            return None  # not even every other slab would do (the rest pinned, say)
        moved = False
        while pool.available(cls) < count:
            starved = pool.available(cls) + len(dram.policy(cls)) < count
            if moved:  # (only a starved class takes more than one)
                return self._a_turn(pool, cls, count)
            if starved and (pool.earmarked_elsewhere(cls) or pool.draining()):
                # another size's request is taking its slabs, a turn at a time: this
                # one waits its turns out, rather than take slabs by turns with it (the
                # later of two then took what the first needed, and the first was refused)
                return Plan(turn=True)
            for donor in self._donors(dram, cls, starved, tenant):
                taken = self._take_slab(dram, donor, protect, starved, tenant)
                if isinstance(taken, Plan):
                    if taken.drains:  # a step of a big slab: the rest in later turns
                        turn = self._a_turn(pool, cls, count)
                        turn.drains += taken.drains
                        return turn
                    return taken
                if taken:
                    break
            else:
                return None
            if not starved:
                return None
            moved = True
        return None

    def from_other_arenas(self, dram: TierSlots, cls: SlabClass, count: int,
                          protect: Block | None) -> Plan | None:
        """Slabs for a per-tenant arena short of ``count`` slots of ``cls`` once the
        budget over the arenas is spent (``kvstore.arena_budget``), while the arena is
        below its weighted share: each the slab of fewest blocks, none in use, of the
        arena furthest over its share, emptied as a slab goes to another class (its
        class's coldest blocks evicted, or written down first: then a Plan to wait on,
        and the call is made again; its blocks moved into their room) and back to the
        budget.  None once the arena has the room, or may take no more this way.

        One slab a turn of the loop, as between classes (``make_way``): a request short
        of several is answered with a Plan of a turn after each, the slab set aside for
        its class meanwhile: several in one call held the loop for each one's evictions,
        copies and the return of its memory (a put of two 64 MiB slabs, 21-26 ms;
        ``benchmarks/arena_hand_over.py``).  CapacityError for an arena holding no slab
        where more arenas write than there are slabs, and none holding one is idle
        (``ArenaBudget.starved``: the slabs bounced between arenas at each request)."""
        pool = dram.pool
        budget = pool.budget
        assert budget is not None, "only arenas with a budget take from each other"
        if pool.available(cls) >= count or not budget.below_share(pool):
            return None
        if budget.starved(pool):
            self._note_reads(pool)
        for donor in budget.over_share(pool):
            taken = self._give_up_slab(self.store.drams[budget.pools[donor]], protect)
            if isinstance(taken, Plan):
                return taken
            if taken:
                budget.taken += 1
                if pool.available(cls) < count and budget.below_share(pool):
                    return self._a_turn(pool, cls, count)
                return None
        if budget.starved(pool):
            budget.held_back += 1
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"more tenants are writing than the {budget.slabs} slabs of dram.capacity "
                f"over their arenas, each slab written or read within "
                f"{budget.min_hold:g} s; raise dram.capacity or lower dram.slab_size",
                cause="arenas")
        return None  # (no arena over its share can give a slab now)

    def wait_for_memory(self, dram: TierSlots, cls: SlabClass, count: int) -> Plan | None:
        """Where the slots of ``count`` of ``cls`` (room made for them) would lie in empty
        slabs whose memory is not there yet (a sparse arena: a page first touched with
        its file system full raises SIGBUS in the process touching it), have it
        allocated (on the daemon's thread) and a Plan of a turn meanwhile."""
        pool = dram.pool
        budget = pool.budget
        assert budget is not None
        budget.used(pool)  # (slots of it taken next: ``ArenaBudget.idle``)
        # what its demand will be once they are (``_note_reads``; or, a turn answered
        # instead, the call made again sets it again)
        self._demand_seen[pool] = _demand(dram) + count * cls.slot_bytes
        missing = unbacked(pool, cls, count)
        if not missing:
            return None
        budget.back(pool, missing - len(pool._backing))
        if not unbacked(pool, cls, count):  # (answered at once)
            return None
        if not any(p._backing for p in budget.pools):  # (none asked for, none coming:
            # every byte of the budget held)
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"the dram arenas hold all of dram.capacity; no slab's memory is free for "
                f"this arena", cause="full")
        turn = self._a_turn(pool, cls, count)
        if budget.waiter is not None:
            turn.wait = budget.waiter()
        return turn

    def check_memory(self, dram: TierSlots, cls: SlabClass, count: int) -> None:
        """CapacityError where the file system had no memory for the arena's last slab
        (``ArenaBudget.is_short``: it takes only slabs that kept their memory then) and
        its own blocks cannot make the room."""
        pool = dram.pool
        budget = pool.budget
        assert budget is not None
        if budget.is_short(pool) and not pool._backing and own_slots(dram, cls) < count:
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"no memory for another slab ({pool.slab_bytes} bytes) of the tenant's "
                f"arena: the file system of dram.directory is full (memory-file arenas: "
                f"the host's or its cgroup's memory is short); free memory there or "
                f"lower dram.capacity", cause="memory")

    def _note_reads(self, asking: SlabPool) -> None:
        """The other arenas whose blocks were hit since last seen (their demand changed
        other than by their own slots taken) were used now, for ``ArenaBudget.idle``: a
        tenant that only read its cache looked idle, and a tenant holding no slab took
        its last one, its whole cache evicted while it read it.  (A halving of the
        demand counts as use too: it comes of use.)"""
        budget = asking.budget
        assert budget is not None
        for pool, name in budget.pools.items():
            dram = self.store.drams.get(name)
            if pool is asking or dram is None:
                continue
            seen = _demand(dram)
            if self._demand_seen.get(pool, seen) != seen:
                budget.used(pool)
            self._demand_seen[pool] = seen

    def _give_up_slab(self, dram: TierSlots, protect: Block | None) -> bool | Plan:
        """Empty a slab of another arena, of the class whose fewest used slab has the
        fewest blocks first (``_take_slab``): True once one went back to the budget."""
        classes = sorted((c for c in dram.pool.classes.values() if c.slabs),
                         key=lambda c: min(s.used for s in c.slabs.values()))
        for donor in classes:
            taken = self._take_slab(dram, donor, protect, True, None)
            if taken:
                return taken
        return False

    def _a_turn(self, pool: SlabPool, cls: SlabClass, count: int) -> Plan:
        """A Plan of a turn for a request of ``cls`` still short of ``count`` slots, the
        empty slabs it will take set aside for the class meanwhile."""
        self.store.counters.slab_turns += 1
        turn = Plan(turn=True)
        set_aside(turn, pool, cls, count)
        return turn

    def _donors(self, dram: TierSlots, cls: SlabClass, starved: bool,
                tenant: str | None) -> list[SlabClass]:
        """The classes to take a slab from, in order: while the asking class is starved,
        every other, furthest over its share first (the next where one has no slab it
        can give: every slab with a pinned block, say; the first alone refused a
        request another class could serve); while it is under its share, the one
        furthest over its share if it is over; every other, most slabs first, for a
        tenant taking from its own blocks."""
        others = [c for c in dram.pool.classes.values() if c is not cls and c.slabs]
        if not others:
            return []
        share = self.shares_of(dram)
        if not starved and len(cls.slabs) + 1 > share.get(cls, 0.0):
            return []
        if tenant is not None:
            return sorted(others, key=lambda c: -len(c.slabs))
        others.sort(key=lambda c: share.get(c, 0.0) - len(c.slabs))
        if starved:
            return others
        donor = others[0]
        if len(donor.slabs) - 1 < share.get(donor, 0.0):
            return []
        return [donor]

    def _take_slab(self, dram: TierSlots, donor: SlabClass, protect: Block | None,
                   wait: bool, tenant: str | None) -> bool | Plan:
        """Empty one slab of ``donor`` into its others (True: it went back to the tier),
        or a Plan of the writes its room waits on (only if ``wait``: a class that is not
        starved makes room among its own blocks rather than wait on another's writes,
        which the tier below may refuse); False if none can be emptied now.  A slab of
        more blocks than a step (``step_blocks``) is emptied a step a turn: a Plan that
        names it in ``drains`` (it is drained until the call is made again)."""
        pool = dram.pool
        if any(s.draining for s in donor.slabs.values()):
            return False  # another call's slab, between its steps: one at a time
        step = step_blocks(donor)
        picked: tuple[Slab, list[tuple[int, Block]] | None] | None
        picked = self._resumed(donor, tenant)
        if picked is None:
            picked = self._movable(dram, donor, protect, tenant)
            if picked is None:
                return False
        slab, blocks = picked
        room = donor.free_slots - (donor.slots_per_slab - slab.used)  # elsewhere than it
        if room < slab.used:  # its blocks' room first, made a step a turn
            short = min(slab.used - room, step)
            if len(dram.policy(donor)) < short:
                return False
            rejects, empty = self.store.counters.capacity_rejects, pool.empty_slabs
            try:
                plan = self.make_room(dram, donor, short, protect, tenant=tenant)
            except CapacityError:
                self.store.counters.capacity_rejects = rejects  # (not the request's)
                return False
            if plan is not None:
                if wait:
                    return plan
                self.put_back(plan.demote + plan.to_remote)  # nothing was written yet
                return False
            if pool.empty_slabs > empty:  # the victims emptied a slab: the tier's now
                self.store.counters.slab_moves += 1
                return True
            if blocks is not None:  # those the victims left (making room pins,
                # reserves and moves nothing)
                blocks = [(offset, b) for offset, b in blocks if b.offset == offset]
                if len(blocks) != slab.used or donor.slabs.get(slab.index) is not slab:
                    return False
            room = donor.free_slots - (donor.slots_per_slab - slab.used)
            if room < slab.used:  # more room to make, in the next turns
                self._checked = (slab, tenant)
                pool.drain(donor, slab)
                return Plan(turn=True, drains=[(pool, donor, slab)])
        if blocks is None:  # (room made in steps: its blocks are looked at now)
            picked = self._movable(dram, donor, protect, tenant)
            if picked is None:
                return False
            slab, blocks = picked
            room = donor.free_slots - (donor.slots_per_slab - slab.used)
        assert blocks is not None
        self._checked = None
        if room >= slab.used and slab.used <= step:  # the whole slab in one go
            news = pool.vacate(donor, slab.index, [offset for offset, _ in blocks])
            self._moved(blocks, news)
            self.store.counters.slab_moves += 1
            return True
        # The rest in later turns, the slab drained and the room made for its blocks
        # held meanwhile (the donor's own writes would take them), whichever call makes
        # the next step (the fewest used of the donor's slabs is picked again: the
        # victims' own slab, if they emptied one).  Its blocks go once their room is made.
        pool.drain(donor, slab)
        if room >= slab.used:
            part = blocks[:step]
            self._moved(part, pool.move_out(donor, slab, [offset for offset, _ in part]))
        return Plan(turn=True, drains=[(pool, donor, slab)])

    def _resumed(self, donor: SlabClass, tenant: str | None
                 ) -> tuple[Slab, list[tuple[int, Block]] | None] | None:
        """The slab whose room the last step made, if it is still the donor's fewest used
        and its room not yet made: its blocks are not looked at again until they move
        (a slab's walk was most of each step's time; one pinned since is found then)."""
        checked = self._checked
        if checked is None or checked[1] != tenant:
            return None
        slab = checked[0]
        if (donor.slabs.get(slab.index) is not slab
                or donor.free_slots - (donor.slots_per_slab - slab.used) >= slab.used
                or any(s.used < slab.used for s in donor.slabs.values())):
            return None
        return slab, None

    def _moved(self, blocks: list[tuple[int, Block]], news: list[int]) -> None:
        """Copy ``blocks`` (each with its offset) to their new offsets, in order."""
        move = self.store.move_bytes
        for (offset, b), new in zip(blocks, news):
            if move is not None:
                move(b.ns, offset, new)
            b.offset = new
        self.store.counters.slab_moved_blocks += len(blocks)

    def _movable(self, dram: TierSlots, donor: SlabClass, protect: Block | None,
                 tenant: str | None) -> tuple[Slab, list[tuple[int, Block]]] | None:
        """A slab of ``donor`` every used slot of which holds a committed block nothing
        reads or writes now (each of ``tenant``'s, if given), fewest used first; and
        those, with their offsets."""
        store = self.store
        busy = {id(b) for t in store.transfers.values() if t.tier == SSD for b in t.blocks}
        busy.update(id(b) for b in store.remote_demoting)
        size = donor.slot_bytes
        for slab in sorted(donor.slabs.values(), key=lambda s: s.used)[:_CANDIDATES]:
            held: list[Any] | None = slab.holders
            if held is None:
                continue  # none placed (reserved)
            blocks: list[tuple[int, Block]] = []
            add = blocks.append
            # (each slot's offset beside what it held: a slab's walk is most of a step)
            for offset, b in zip(range(slab.base, slab.base + len(held) * size, size), held):
                if b is None or b.offset != offset or not isinstance(b, Block):
                    continue  # a slot freed since
                if (b.refs or (b.rare is not None and (b.demoting or b.promoting))
                        or b is protect or (busy and id(b) in busy)
                        or (tenant is not None and b.ns.tenant != tenant)):
                    break
                add((offset, b))
            else:
                if len(blocks) == slab.used:  # (else slots reserved, or being filled)
                    return slab, blocks
        return None


def class_stats(store: StoreCore) -> dict[str, list[dict[str, Any]]]:
    """Each slab class of each tier: its slot size, the slabs it holds and, for a DRAM
    tier's, its share of them by recent use (what ``make_way`` moves slabs towards)."""
    dram = [{"arena": name, "slot_bytes": cls.slot_bytes, "slabs": len(cls.slabs),
             "share": round(share, 2)}
            for name, tier in store.drams.items()
            for cls, share in SlabMoves.shares_of(tier).items()]
    ssd = ([] if store.ssd is None else
           [{"slot_bytes": cls.slot_bytes, "slabs": len(cls.slabs)}
            for cls in store.ssd.pool.classes.values()])
    return {"dram": dram, "ssd": ssd}


class StopTrades:
    """What the flush on the way out (``ssd_flush``) may give up on the SSD tier for
    blocks only DRAM holds: within a size, the copies ``victim`` passes; between sizes,
    slabs of the size with most (``empty_ssd_slab``), as a demotion takes them while
    serving, none of ``planned`` (the blocks the flush writes) touched, and of each
    size at most ``spare`` says (``spare_of``: shared by the flush's batches)."""

    def __init__(self, victim: Callable[[Block], bool], spare: dict[int, int],
                 planned: AbstractSet[Block]) -> None:
        self.victim, self.spare, self.planned = victim, spare, planned

    @staticmethod
    def spare_of(pool: SlabPool) -> dict[int, int]:
        """The slabs each class of ``pool`` may give through the flush: half of those it
        holds now (the tier's older content is not all traded away, and a stop withdraws
        at most half the tier's records); none taken during the flush."""
        return {c.slot_bytes: len(c.slabs) // 2 for c in pool.classes.values()}

    def __call__(self, b: Block) -> bool:
        return self.victim(b)

    def may_give(self, donor: SlabClass) -> bool:
        return self.spare.get(donor.slot_bytes, 0) > 0

    def gave(self, donor: SlabClass) -> None:
        self.spare[donor.slot_bytes] -= 1


def empty_ssd_slab(store: StoreCore, cls: SlabClass, removed: list[tuple[bytes, bytes]],
                   keep: set[Block], stop: StopTrades | None = None) -> bool:
    """Give ``cls`` (an SSD class with nothing to evict) a slab of the SSD class with
    the most, emptied by dropping its copies (``removed``: the index records to delete),
    none of ``keep`` (the blocks being written) touched; False if no slab of it can be
    emptied now (a copy being read, or a block below one in use, say).  On the way out
    (``stop``), only as its rules say; a block DRAM also holds then counts as one only
    the SSD tier holds (DRAM goes with the stop: kept without its SSD copy, what hangs
    below it would be dropped at restart as orphans), and goes with what hangs below."""
    ssd = store.ssd
    assert ssd is not None
    pool = ssd.pool
    # (the flush's planned blocks, every block only DRAM holds, asked about, never
    # copied: a copy for each slab traded held the loop ~40 ms at a million blocks)
    planned: AbstractSet[Block] = stop.planned if stop is not None else frozenset()
    # (a donor keeps a slab: two sizes starved in turn would take one slab back and
    # forth, dropping every copy in it each time)
    donors = [c for c in pool.classes.values() if c is not cls and len(c.slabs) > 1
              and (stop is None or stop.may_give(c))]
    if not donors:
        return False
    donor = max(donors, key=lambda c: len(c.slabs))
    ranked: list[tuple[tuple[int, int], int, Slab, list[Block]]] = []
    for slab in sorted(donor.slabs.values(), key=lambda s: s.used)[:_CANDIDATES]:
        blocks: list[Block] = []
        inner = 0  # SSD-only blocks with others below: those go with them
        for offset, b in pool.holders_of(donor, slab):
            if not isinstance(b, Block) or b.ssd_offset != offset or b.ns.ssd_cls is not donor:
                continue  # a slot freed since
            if _busy(b) or b in keep or b in planned:
                break
            blocks.append(b)
            inner += (b.offset is None or stop is not None) and b.kids is not None
        else:
            if len(blocks) == slab.used:
                ranked.append(((inner, slab.used), slab.index, slab, blocks))
    for _, _, slab, blocks in sorted(ranked, key=lambda r: r[:2]):
        below = [x for b in blocks if (b.offset is None or stop is not None)
                 and b.kids is not None for x in subtree(b)]
        if any(_busy(x) or x in keep or x in planned for x in below):
            continue  # (a block below in use would keep its SSD-only parents)
        dropped = 0
        for b in blocks:
            if b.ssd_offset is None:
                continue  # gone with a block above it
            if (b.offset is not None and stop is None) or b.kids is None:
                removed.append(store.drop_ssd_copy(b))
                dropped += 1
            else:
                before = len(removed)
                store.drop_subtree(b.ns, [b], removed)
                dropped += len(removed) - before
        store.counters.ssd_slab_moves += 1
        store.counters.ssd_slab_dropped += dropped
        emptied = donor.slabs.get(slab.index) is not slab
        if emptied and stop is not None:
            stop.gave(donor)
        return emptied
    return False


def ssd_refused(store: StoreCore) -> frozenset[SlabClass]:
    """The SSD classes no slab can be found for (none of their own, none empty, no
    class with one to spare: an SSD tier of one slab): their blocks are not written
    there (a demotion planned for them would fail, and be planned again, for good)."""
    ssd = store.ssd
    if ssd is None or ssd.pool.empty_slabs:
        return frozenset()
    classes = ssd.pool.classes.values()
    if any(len(c.slabs) > 1 for c in classes):
        return frozenset()
    return frozenset(c for c in classes if not c.slabs)


def _busy(b: Block) -> bool:
    """Whether a block is in use: pinned, or a copy of it being read or written."""
    return bool(b.refs or b.ssd_holds or b.promoting or b.demoting)


def set_aside(turn: Plan, pool: SlabPool, cls: SlabClass, count: int) -> None:
    """Set aside for ``turn`` the empty slabs a call of ``count`` slots of ``cls`` will
    take when made again (those of them no class has set aside), beside those it has:
    also where the call gave back slots it had taken (a batch's earlier items, aborted
    while a later one waits for its slab), which would go to any size meanwhile."""
    wanted = -(-(count - cls.free_slots) // cls.slots_per_slab)
    more = pool.earmark(cls, wanted - sum(n for _, _, n in turn.earmarks))
    if more:
        turn.earmarks.append((pool, cls, more))


def _demand(dram: TierSlots) -> float:
    """What a DRAM tier's classes used lately, together (slots taken and hits)."""
    return sum(dram.demand.values())


def own_slots(dram: TierSlots, cls: SlabClass) -> int:
    """The slots a request of ``cls`` could have now without another class's slab:
    free (empty slabs set aside for others aside), or evictable."""
    return dram.pool.available(cls) + len(dram.policy(cls))


def reachable_slots(dram: TierSlots, cls: SlabClass) -> int:
    """The slots a request of ``cls`` could have now: its own (``own_slots``), or in
    slabs the other classes could hand over (their free and evictable, in whole slabs),
    or, the budget over per-tenant arenas spent, other arenas up to its arena's share."""
    slots = own_slots(dram, cls)
    for other in dram.pool.classes.values():
        if other is not cls and other.slabs:
            spare = (other.free_slots + len(dram.policy(other))) // other.slots_per_slab
            slots += min(spare, len(other.slabs)) * cls.slots_per_slab
    budget = dram.pool.budget
    if budget is not None and not budget.spare:  # up to its share, from other arenas
        slots += max(0, int(budget.shares(dram.pool)[dram.pool] + 1e-9)
                     - held(dram.pool)) * cls.slots_per_slab
    return slots
