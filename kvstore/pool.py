"""Slab pool: fixed-size slots carved out of one tier's byte range.

Block sizes differ between namespaces, so the tier's range is cut into slabs of
``slab_bytes`` and each slab serves slots of one size class, as memcached does.  A slab
whose slots are all free goes back to the tier, and a slab a class can spare is
emptied into its other slabs' free slots (``vacate``) and given to another class.  The
pool deals in byte offsets; what a slot holds it only remembers (``place``), so that the
slab's holders can be found without a walk of every block, and moved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import TooLargeError

if TYPE_CHECKING:
    from kvstore.arena_budget import ArenaBudget


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class Slab:
    """One slab: a bump pointer over never-used slots plus a stack of freed ones."""

    __slots__ = ("index", "base", "next_unused", "freed", "used", "free_set", "claimed",
                 "holders", "draining")

    def __init__(self, index: int, base: int) -> None:
        self.index = index
        self.base = base
        self.next_unused = 0
        self.freed: list[int] = []
        self.used = 0
        # While slots are claimed out of order (a warm restart): the free ones of
        # ``freed`` as a set, and those claimed but still in ``freed``, dropped from it
        # at the next other use; so that each claim is O(1), not a walk of ``freed``.
        self.free_set: set[int] | None = None
        self.claimed: set[int] | None = None
        # What each slot held when last ``place``d, by slot number (None until one was):
        # stale for a slot freed since, so its reader checks the holder still holds it.
        self.holders: list[object] | None = None
        # While its blocks are moved out a turn at a time (``SlabPool.drain``): none of
        # its slots is handed out, nor counted free in its class.
        self.draining = False

    def settle(self) -> None:
        """Drop the slots claimed out of order from ``freed``."""
        if self.claimed:
            claimed = self.claimed
            self.freed = [o for o in self.freed if o not in claimed]
        self.free_set = self.claimed = None


class SlabClass:
    """All slabs of one slot size in one tier."""

    def __init__(self, slot_bytes: int, slots_per_slab: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slots_per_slab
        self.slabs: dict[int, Slab] = {}
        self._with_room: dict[int, Slab] = {}  # slabs that still have a free slot
        self.free_slots = 0

    @property
    def capacity_slots(self) -> int:
        return len(self.slabs) * self.slots_per_slab

    def _take(self) -> int:
        slab = next(iter(self._with_room.values()))
        if slab.free_set is not None:
            slab.settle()
        if slab.freed:
            offset = slab.freed.pop()
        else:
            offset = slab.base + slab.next_unused * self.slot_bytes
            slab.next_unused += 1
        slab.used += 1
        self.free_slots -= 1
        if slab.used == self.slots_per_slab:
            del self._with_room[slab.index]
        return offset

    def _take_many(self, count: int) -> list[int]:
        """``count`` free slots, in the order ``_take`` would give them, a slab's run at
        a time (there must be so many free)."""
        out: list[int] = []
        size = self.slot_bytes
        while len(out) < count:
            slab = next(iter(self._with_room.values()))
            if slab.free_set is not None:
                slab.settle()
            want = count - len(out)
            if slab.freed:
                k = min(want, len(slab.freed))
                out.extend(reversed(slab.freed[-k:]))  # popped from the end, one by one
                del slab.freed[-k:]
            else:
                k = min(want, self.slots_per_slab - slab.next_unused)
                start = slab.base + slab.next_unused * size
                out.extend(range(start, start + k * size, size))
                slab.next_unused += k
            slab.used += k
            self.free_slots -= k
            if slab.used == self.slots_per_slab:
                del self._with_room[slab.index]
        return out

    def __repr__(self) -> str:
        return (f"SlabClass(slot_bytes={self.slot_bytes}, slabs={len(self.slabs)}, "
                f"free_slots={self.free_slots}/{self.capacity_slots})")


class SlabPool:
    """The slots of one tier, in slabs of one size class each."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, alignment: int = 64) -> None:
        if capacity_bytes < 0 or slab_bytes <= 0:
            raise ValueError("capacity and slab size must be positive")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = min(slab_bytes, capacity_bytes) if capacity_bytes else slab_bytes
        self.alignment = alignment
        self.num_slabs = capacity_bytes // self.slab_bytes if self.slab_bytes else 0
        self._empty: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self.classes: dict[int, SlabClass] = {}
        self._owner: dict[int, SlabClass] = {}  # slab index -> class using it
        # Empty slabs set aside for a class while a request of it that needs several
        # lets the loop serve others between them (``earmark``): no other class takes
        # them meanwhile.  A count per class (any empty slab will do), at most the
        # empty slabs in all.
        self._earmarked: dict[SlabClass, int] = {}
        self._earmarked_total = 0
        # Slabs whose blocks are being moved out, a turn at a time, so that another
        # class gets the slab (``drain``): slab index -> its class and the other free
        # slots of its class held for its blocks (a list, updated); and the drains not
        # yet ended (``undrain``), given back or emptied or not.
        self._drains: dict[int, list[Any]] = {}
        self._unended = 0
        self.budget: ArenaBudget | None = None  # over all arenas (``kvstore.arena_budget``)
        self._resident: set[int] = set()  # empty, pages kept (``ArenaBudget.grew``)
        self._backing: set[int] = set()  # empty, its memory being allocated (``back``)

    # -- size classes ---------------------------------------------------------
    def slot_bytes_for(self, block_bytes: int) -> int:
        slot = align_up(block_bytes, self.alignment)
        if slot > self.slab_bytes:
            raise TooLargeError(
                f"a block of {block_bytes} bytes does not fit a slab of {self.slab_bytes} "
                f"bytes in a tier of {self.capacity_bytes} bytes; raise the tier capacity "
                f"or slab size"
            )
        return slot

    def class_for(self, block_bytes: int) -> SlabClass:
        slot = self.slot_bytes_for(block_bytes)
        cls = self.classes.get(slot)
        if cls is None:
            cls = self.classes[slot] = SlabClass(slot, self.slab_bytes // slot)
        return cls

    # -- allocation -----------------------------------------------------------
    @property
    def empty_slabs(self) -> int:
        return len(self._empty)

    def empty_for(self, cls: SlabClass) -> int:
        """The empty slabs ``cls`` may take: all but those set aside for other classes."""
        return _takeable(self) + self._earmarked.get(cls, 0)

    def available(self, cls: SlabClass) -> int:
        """Slots the class can hand out now without evicting anything."""
        return cls.free_slots + self.empty_for(cls) * cls.slots_per_slab

    def earmark(self, cls: SlabClass, count: int) -> int:
        """Set up to ``count`` empty slabs aside for ``cls`` (of those no class has set
        aside); how many were."""
        count = max(0, min(count, _takeable(self)))
        if count:
            self._earmarked[cls] = self._earmarked.get(cls, 0) + count
            self._earmarked_total += count
        return count

    def release(self, cls: SlabClass, count: int) -> None:
        """Let ``count`` slabs set aside for ``cls`` go to any class again (fewer if the
        class took some of them meanwhile)."""
        held = self._earmarked.get(cls, 0)
        count = min(count, held)
        if count == held:
            self._earmarked.pop(cls, None)
        else:
            self._earmarked[cls] = held - count
        self._earmarked_total -= count

    def earmarked(self, cls: SlabClass) -> int:
        """Empty slabs set aside for ``cls`` now."""
        return self._earmarked.get(cls, 0)

    def earmarked_elsewhere(self, cls: SlabClass) -> int:
        """Empty slabs set aside for classes other than ``cls`` now."""
        return self._earmarked_total - self._earmarked.get(cls, 0)

    def drain(self, cls: SlabClass, slab: Slab) -> None:
        """Hand out no slot of ``slab`` (of ``cls``), nor as many of the class's other
        free slots as its blocks need, until ``undrain``: the slab's blocks are being
        moved into those (``move_out``), a turn at a time, for the slab to go to another
        class, and the class's own writes would take them meanwhile (slots its blocks free
        later are its own again).  One slab of a class at a time.  A block of the
        slab that goes meanwhile (the class's own eviction) frees a slot held elsewhere,
        or, none held, gives the slab back to the class: it made room for itself.  Until
        ``undrain``, other calls see a slab being emptied (``draining``) either way."""
        assert cls.slabs.get(slab.index) is slab and not slab.draining
        assert not any(c is cls for c, _ in self._drains.values()), "one at a time"
        slab.draining = True
        cls._with_room.pop(slab.index, None)
        cls.free_slots -= cls.slots_per_slab - slab.used
        held = min(cls.free_slots, slab.used)  # (the slots held for its blocks)
        self._drains[slab.index] = [cls, held]
        cls.free_slots -= held
        self._unended += 1

    def undrain(self, cls: SlabClass, slab: Slab) -> None:
        """The end of ``drain``'s hold: the slab's free slots, and those held for its
        blocks, are the class's again (nothing more if it emptied meanwhile and went
        back to the tier, or was given back)."""
        self._unended -= 1
        if slab.draining:
            _give_back(self, cls, slab)

    def draining(self) -> int:
        """Slabs being emptied now, for any class (a call's own drains are let go
        before it is made again: what it sees are other calls')."""
        return self._unended

    def move_out(self, cls: SlabClass, slab: Slab, olds: Sequence[int]) -> list[int]:
        """Move the blocks in slots ``olds`` of ``slab`` (draining) into free slots of the
        class's other slabs, those held for it first (there must be that many): the new
        offset of each, in order, holders moved with them.  The slab goes back to the
        tier once it is empty."""
        drain = self._drains[slab.index]
        take = min(drain[1], len(olds))
        drain[1] -= take
        cls.free_slots += take
        assert cls.free_slots >= len(olds), "too few free slots elsewhere"
        news = cls._take_many(len(olds)) if olds else []
        held = slab.holders
        if held is not None and news:  # (the holders' offsets are the caller's to set)
            size = cls.slot_bytes
            self.place_at(cls, news, [held[(old - slab.base) // size] for old in olds])
        if slab.free_set is not None:
            slab.settle()
        slab.freed.extend(olds)
        slab.used -= len(olds)
        if slab.used == 0:
            _let_drained_go(self, cls, slab)
        return news

    def allocate(self, cls: SlabClass, count: int) -> list[int] | None:
        """``count`` slot offsets, or None (and nothing taken) if not free (``unbacked``)."""
        if count > self.available(cls) or unbacked(self, cls, count):
            return None
        grew = False
        while cls.free_slots < count:
            self._grow(cls)
            grew = True
        if grew and any(c is cls for c, _ in self._drains.values()):
            # its free slots held for a drain lie in the slabs it had: the new ones
            # first, or one would be kept empty while those are taken
            fresh = {i: s for i, s in cls._with_room.items() if s.used == 0}
            cls._with_room = {**fresh, **cls._with_room}
        return cls._take_many(count)

    def free(self, cls: SlabClass, offsets: list[int]) -> None:
        for offset in offsets:
            index = offset // self.slab_bytes
            slab = cls.slabs[index]
            if slab.free_set is not None:
                slab.settle()
            slab.freed.append(offset)
            slab.used -= 1
            if slab.draining:  # (its slots are not the class's to hand out)
                drain = self._drains[index]
                if slab.used == 0:
                    _let_drained_go(self, cls, slab)
                elif drain[1]:  # one block fewer to move: a slot held for them is free
                    drain[1] -= 1
                    cls.free_slots += 1
                else:  # the class needs the slot it freed (its own eviction): all go back
                    _give_back(self, cls, slab)
                continue
            cls.free_slots += 1
            cls._with_room[index] = slab
            if slab.used == 0:
                self._shrink(cls, slab)

    # -- what slots hold, and emptying a slab into the class's others ---------------------
    def place(self, cls: SlabClass, holders: Sequence[Any]) -> None:
        """Remember what holds each slot: ``holders``, each at its ``offset`` (slots of
        ``cls``; ``holders_of`` lists them).  A reservation's slots come in runs within a
        slab, so the slab is looked up once a run (a commit's cost: about 60 ns a block)."""
        slab_bytes, size, slabs = self.slab_bytes, cls.slot_bytes, cls.slabs
        base = end = 0
        held: list[object] = []
        for holder in holders:
            offset = holder.offset
            if not base <= offset < end:
                slab = slabs[offset // slab_bytes]
                base, end = slab.base, slab.base + slab_bytes
                if slab.holders is None:
                    slab.holders = [None] * cls.slots_per_slab
                held = slab.holders
            held[(offset - base) // size] = holder

    def place_at(self, cls: SlabClass, offsets: Sequence[int],
                 holders: Sequence[object]) -> None:
        """``place``, the offsets given apart (an SSD tier's copies, say)."""
        slab_bytes, size, slabs = self.slab_bytes, cls.slot_bytes, cls.slabs
        for offset, holder in zip(offsets, holders):
            slab = slabs[offset // slab_bytes]
            if slab.holders is None:
                slab.holders = [None] * cls.slots_per_slab
            slab.holders[(offset - slab.base) // size] = holder

    def holder(self, cls: SlabClass, offset: int) -> object | None:
        """What was placed in the slot at ``offset`` last (None if nothing was)."""
        index, within = divmod(offset, self.slab_bytes)
        held = cls.slabs[index].holders
        return None if held is None else held[within // cls.slot_bytes]

    def holders_of(self, cls: SlabClass, slab: Slab) -> list[tuple[int, object]]:
        """(offset, what was placed there last) for each slot of ``slab`` a holder was
        placed in, in slot order (a slot freed since keeps its last holder)."""
        held = slab.holders
        if held is None:
            return []
        base, size = slab.base, cls.slot_bytes
        return [(base + i * size, h) for i, h in enumerate(held) if h is not None]

    def vacate(self, cls: SlabClass, index: int, olds: Sequence[int]) -> list[int]:
        """Empty slab ``index`` of ``cls``, every used slot of which is in ``olds``, into
        free slots of the class's other slabs (there must be that many): the new offset of
        each, in order, holders moved with them.  The slab goes back to the tier."""
        slab = cls.slabs[index]
        assert len(olds) == slab.used, "every used slot of the slab is moved"
        free_here = cls.slots_per_slab - slab.used
        assert cls.free_slots - free_here >= slab.used, "too few free slots elsewhere"
        cls._with_room.pop(index, None)  # out of ``_take_many``'s reach
        cls.free_slots -= free_here
        news = cls._take_many(len(olds)) if olds else []
        held = slab.holders
        if held is not None and news:  # (the holders' offsets are the caller's to set)
            size = cls.slot_bytes
            self.place_at(cls, news, [held[(old - slab.base) // size] for old in olds])
        del cls.slabs[index]
        del self._owner[index]
        _to_empty(self, index)
        return news

    def claim(self, cls: SlabClass, offset: int) -> bool:
        """Mark the slot at ``offset`` used (rebuilding a tier at start-up); False if that
        slot does not exist for this class or is taken."""
        index, within = divmod(offset, self.slab_bytes)
        slot, rest = divmod(within, cls.slot_bytes)
        if offset < 0 or index >= self.num_slabs or rest or slot >= cls.slots_per_slab:
            return False
        owner = self._owner.get(index)
        if owner is None:
            self._empty.remove(index)
            self._grow(cls, index)
        elif owner is not cls:
            return False
        slab = cls.slabs[index]
        if slot >= slab.next_unused:
            gap = [slab.base + i * cls.slot_bytes for i in range(slab.next_unused, slot)]
            slab.freed.extend(gap)
            if slab.free_set is not None:
                slab.free_set.update(gap)
            slab.next_unused = slot + 1
        else:
            if slab.free_set is None:
                slab.free_set, slab.claimed = set(slab.freed), set()
            if offset not in slab.free_set:
                return False
            assert slab.claimed is not None
            slab.free_set.remove(offset)
            slab.claimed.add(offset)
        slab.used += 1
        cls.free_slots -= 1
        if slab.used == cls.slots_per_slab:
            del cls._with_room[index]
        return True

    def claim_many(self, cls: SlabClass, offsets: Sequence[int]) -> list[bool]:
        """``claim`` each offset in turn (a warm restart's slots, in any order); one bool
        each.  A slab no slot of which was in use is rebuilt in one pass over its
        claims, in arrays, not a claim at a time."""
        n = len(offsets)
        try:
            at = np.fromiter(offsets, dtype=np.int64, count=n)
        except OverflowError:  # past any slot: marked so
            at = np.array([o if 0 <= o < self.capacity_bytes else -1 for o in offsets],
                          dtype=np.int64)
        size, per = cls.slot_bytes, cls.slots_per_slab
        index, within = np.divmod(at, self.slab_bytes)
        slot, rest = np.divmod(within, size)
        valid = (at >= 0) & (index < self.num_slabs) & (rest == 0) & (slot < per)
        ok = np.zeros(n, dtype=bool)
        positions = np.flatnonzero(valid)
        # the slabs claimed, in the order of their first claim
        slabs, first = np.unique(index[positions], return_index=True)
        slabs = slabs[np.argsort(first, kind="stable")].tolist()
        fresh = [i for i in slabs if i not in self._owner]
        gone = set(fresh)
        if fresh:
            self._empty = [i for i in self._empty if i not in gone]
            news = positions[np.isin(index[positions], fresh)]
            # the first claim of each slot wins (``claim`` refuses the later ones)
            slots, won = np.unique(index[news] * per + slot[news], return_index=True)
            ok[news[won]] = True
            slab_of = slots // per
            cuts = np.flatnonzero(np.diff(slab_of)) + 1
            taken = dict(zip(slab_of[np.r_[0, cuts]].tolist(), np.split(slots % per, cuts)))
            for i in fresh:
                self._grow(cls, i)
                self._fill(cls, cls.slabs[i], taken[i])
        # slabs of this class in use before: a claim at a time (slabs apart do not meet)
        used = [i for i in slabs if i not in gone and self._owner[i] is cls]
        if used:
            mine = positions[np.isin(index[positions], used)]
            for pos, offset in zip(mine.tolist(), at[mine].tolist()):
                ok[pos] = self.claim(cls, offset)
        return ok.tolist()

    def _fill(self, cls: SlabClass, slab: Slab, taken: np.ndarray) -> None:
        """Mark the claimed slots (ascending, each once) of a new slab used, the others
        below the highest free."""
        top = int(taken[-1]) + 1
        size = cls.slot_bytes
        slab.freed = (np.setdiff1d(np.arange(top), taken, assume_unique=True) * size
                      + slab.base).tolist()
        slab.next_unused = top
        used = len(taken)
        slab.used = used
        cls.free_slots -= used
        if used == cls.slots_per_slab:
            del cls._with_room[slab.index]

    def _grow(self, cls: SlabClass, index: int | None = None) -> None:
        if index is None:
            index = _next_empty(self)
            if self._earmarked.get(cls):  # one set aside for the class: taken
                self.release(cls, 1)
        else:
            self._resident.discard(index)
        slab = Slab(index, index * self.slab_bytes)
        cls.slabs[index] = slab
        cls._with_room[index] = slab
        cls.free_slots += cls.slots_per_slab
        self._owner[index] = cls
        _grew(self)

    def _shrink(self, cls: SlabClass, slab: Slab) -> None:
        del cls.slabs[slab.index]
        del cls._with_room[slab.index]
        del self._owner[slab.index]
        cls.free_slots -= cls.slots_per_slab
        _to_empty(self, slab.index)

    # -- inspection -----------------------------------------------------------
    def free_offsets(self, cls: SlabClass) -> Iterator[int]:
        """Every free slot of the class, computed from the slabs themselves."""
        for slab in cls.slabs.values():
            claimed = slab.claimed or ()
            yield from (o for o in slab.freed if o not in claimed)
            for i in range(slab.next_unused, cls.slots_per_slab):
                yield slab.base + i * cls.slot_bytes

    def tail_waste_bytes(self) -> int:
        """Bytes no slot can use: slab remainders and the tier's remainder."""
        waste = self.capacity_bytes - self.num_slabs * self.slab_bytes
        for cls in self.classes.values():
            waste += len(cls.slabs) * (self.slab_bytes - cls.slots_per_slab * cls.slot_bytes)
        return waste

    def check(self) -> None:
        """Slabs are owned once each; per-class free counts match the slabs."""
        owned = set(self._owner)
        assert not owned & set(self._empty), "a slab is both empty and owned"
        assert 0 <= self._earmarked_total <= len(self._empty), "more set aside than empty"
        assert sum(self._earmarked.values()) == self._earmarked_total and all(
            n > 0 for n in self._earmarked.values()), "the slabs set aside miscounted"
        assert len(owned) + len(self._empty) == self.num_slabs, "a slab went missing"
        if self.budget is not None:
            self.budget.check()
        assert all(held >= 0 and i in of.slabs and of.slabs[i].draining
                   and self._owner.get(i) is of
                   for i, (of, held) in self._drains.items()), "a drain miscounted"
        assert self._unended >= len(self._drains), "a drain's end miscounted"
        for cls in self.classes.values():
            draining = sum(cls.slots_per_slab - s.used for s in cls.slabs.values() if s.draining)
            draining += sum(held for c, held in self._drains.values() if c is cls)
            counted = sum(1 for _ in self.free_offsets(cls)) - draining
            assert counted == cls.free_slots, (
                f"class {cls.slot_bytes}: {counted} free slots in slabs, "
                f"{cls.free_slots} counted"
            )
            for index, slab in cls.slabs.items():
                assert self._owner[index] is cls, "slab owned by another class"
                assert 0 < slab.used <= cls.slots_per_slab, "an empty slab was kept"

    def __repr__(self) -> str:
        return (f"SlabPool(capacity={self.capacity_bytes}, slab_bytes={self.slab_bytes}, "
                f"empty_slabs={len(self._empty)}/{self.num_slabs}, "
                f"classes={list(self.classes.values())})")


def unbacked(pool: SlabPool, cls: SlabClass, count: int) -> int:
    """Of the empty slabs an ``allocate`` of ``count`` slots of ``cls`` would take, those
    whose memory is not there yet (``ArenaBudget.back``); 0 without a budget."""
    if pool.budget is None:
        return 0
    return pool.budget.unbacked(pool, max(0, -(-(count - cls.free_slots)
                                             // cls.slots_per_slab)))


def _give_back(pool: SlabPool, cls: SlabClass, slab: Slab) -> None:
    """A draining slab's drain ended: its free slots and those held are the class's."""
    slab.draining = False
    _, held = pool._drains.pop(slab.index)
    cls.free_slots += held + cls.slots_per_slab - slab.used
    if slab.used < cls.slots_per_slab:
        cls._with_room[slab.index] = slab  # (last: the class's other slabs first)


def _let_drained_go(pool: SlabPool, cls: SlabClass, slab: Slab) -> None:
    """A draining slab emptied: to the tier, the slots held for it the class's again."""
    slab.draining = False
    cls.free_slots += pool._drains.pop(slab.index)[1]
    del cls.slabs[slab.index]
    del pool._owner[slab.index]
    _to_empty(pool, slab.index)


def _takeable(pool: SlabPool) -> int:
    """The empty slabs no class has set aside that the pool may take: with a budget over
    all arenas, no more than it has left."""
    unset = len(pool._empty) - pool._earmarked_total
    budget = pool.budget
    if budget is None:
        return unset
    if budget.is_short(pool):  # (no memory for another: only slabs that kept theirs)
        return min(unset, budget.spare, len(pool._resident))
    return min(unset, budget.spare)


def _grew(pool: SlabPool) -> None:
    """A slab was taken: with a budget, its pages, written from now on, are the budget's
    (``ArenaBudget.grew``), and the pool's next slab is backed ahead."""
    if pool.budget is not None:
        pool.budget.grew(pool)


def _to_empty(pool: SlabPool, index: int) -> None:
    """Slab ``index`` is empty: the pool's again, and with a budget, the budget's, its
    pages kept until another arena needs the memory (``ArenaBudget.grew``)."""
    pool._empty.append(index)
    if pool.budget is not None:
        pool._resident.add(index)


def _next_empty(pool: SlabPool) -> int:
    """The empty slab a class takes: one whose pages are still there first (no memory
    taken anew, none given back for it), else the last emptied."""
    if pool._resident:
        index = pool._resident.pop()
        pool._empty.remove(index)  # (a list of at most the pool's slabs)
        return index
    return pool._empty.pop()
