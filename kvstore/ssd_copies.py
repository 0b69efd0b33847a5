"""Which blocks have a copy in the SSD tier, and how copies enter and leave it: writes
(demotion and write-through), promotion back to DRAM, the remote store's write-back
from SSD, corruption, and the warm restart.  Pure bookkeeping over slot offsets; the
daemon's SSD mover moves the bytes and reports back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, Protocol, cast

from kvstore.block_map import SHARDS, SPLIT_AT
from kvstore.blocks import (
    DRAM,
    REMOTE_MARK,
    SEEN_SHIFT,
    SSD,
    Block,
    Namespace,
    Transfer,
)
from kvstore.core import StoreCore
from kvstore.dram_copies import check_slots
from kvstore.errors import CapacityError
from kvstore.first_blocks import Heads, also_heads
from kvstore.plans import Plan
from kvstore.room import RoomMaker
from kvstore.scheduler.eviction import EvictionPolicy, LRUPolicy
from kvstore.scheduler.tenant_orders import TenantOrders
from kvstore.slab_moves import StopTrades, empty_ssd_slab

_ORDERED = (LRUPolicy, TenantOrders)  # orders that say which copies are coldest
_CLEAN_VICTIM_REACH = 64  # SSD copies looked at for one the remote store also holds
_SEND_WINDOW_BYTES = 256 << 20  # the coldest SSD copies kept sent remotely (write-back)


class SsdCopies:
    """The store's SSD tier: copies, their writes and reads, in the store's terms (a
    ``Tier``)."""

    name = SSD

    def __init__(self, store: StoreCore, room: RoomMaker) -> None:
        self.store = store
        self.room = room

    # -- the tier interface -------------------------------------------------------------
    def holds(self, block: Block) -> bool:
        return block.ssd_offset is not None

    def drop(self, block: Block) -> None:
        self.store.dropped_ssd.append(self.store.drop_ssd_copy(block))

    def stats(self) -> dict[str, int]:
        store, c = self.store, self.store.counters
        assert store.ssd is not None
        spool = store.ssd.pool
        committed = store.ssd_committed_bytes
        reserved = sum(len(t.offsets) * (t.blocks[0].ns.ssd_cls.slot_bytes
                                          if t.blocks and t.blocks[0].ns.ssd_cls else 0)
                       for t in store.transfers.values() if t.tier == SSD)
        return {
            "capacity": spool.capacity_bytes,
            "free": spool.capacity_bytes - reserved - committed,
            "reserved": reserved, "committed": committed,
            "reserved_slots": store.ssd_reserved_slots,
            "committed_slots": store.ssd_committed_slots,
            "blocks": store.ssd_committed_slots, "pinned_blocks": 0,
            "tail_waste": spool.tail_waste_bytes(), "empty_slabs": spool.empty_slabs,
            "evictions": c.ssd_evictions, "evicted_unwritten": c.ssd_evicted_unwritten,
            "demotions": c.demotions, "writes": c.ssd_writes,
            "checksum_failures": c.checksum_failures, "hits": c.ssd_hits,
            "slab_moves": c.ssd_slab_moves, "slab_dropped": c.ssd_slab_dropped,
        }

    def check(self, blocks: Iterable[Block]) -> None:
        """Per slab class: free + reserved (writes under way) + committed == capacity,
        one state per slot; the order holds exactly the SSD copies."""
        store = self.store
        assert store.ssd is not None
        reserved: dict[int, list[int]] = {}
        for t in store.transfers.values():
            if t.tier == SSD:
                for b, off in zip(t.blocks, t.offsets):
                    assert b.ns.ssd_cls is not None
                    reserved.setdefault(b.ns.ssd_cls.slot_bytes, []).append(off)
        committed: dict[int, list[int]] = {}
        for b in blocks:
            if b.ssd_offset is not None:
                assert b.ns.ssd_cls is not None
                committed.setdefault(b.ns.ssd_cls.slot_bytes, []).append(b.ssd_offset)
        pool = store.ssd.pool
        pool.check()
        for slot_bytes, cls in pool.classes.items():
            mine = committed.get(slot_bytes, [])
            check_slots(SSD, pool.free_offsets(cls), reserved.get(slot_bytes, []), mine,
                        cls.capacity_slots, slot_bytes)
            policy = store.ssd.policies.get(slot_bytes)
            if policy is None:
                continue
            for b in policy.evictable():
                assert b.ns.blocks.get(b.key) is b, f"{b} on the order but not cached"
                assert b.ssd_offset is not None, f"{b} on the ssd order without a copy"
            assert len(policy) == len(mine), (
                f"ssd class {slot_bytes}: {len(policy)} on the eviction order, "
                f"{len(mine)} expected")
        assert sum(map(len, committed.values())) == store.ssd_committed_slots, (
            "ssd committed counter is off")
        assert sum(size * len(offs) for size, offs in committed.items()) \
            == store.ssd_committed_bytes, "ssd committed byte counter is off"

    # -- SSD: demotion, write-through, promotion, restart -----------------------------------
    def reserve(self, blocks: list[Block], evict: bool | Callable[[Block], bool] = True
                ) -> tuple[Transfer, list[tuple[bytes, bytes]]]:
        """SSD slots for blocks about to be written there, evicting cold SSD copies (none:
        CapacityError where there is no room; a test: only copies it passes); returns the
        transfer and the keys whose SSD copies went (to withdraw from the index)."""
        assert self.store.ssd is not None, "no SSD tier"
        for b in blocks:
            assert b.offset is not None and b.ssd_offset is None, f"{b} cannot go to ssd now"
        self.room.demotions_planned.difference_update(blocks)  # (a transfer's from here)
        removed: list[tuple[bytes, bytes]] = []
        offsets: list[int] = []
        placed: list[Block] = []  # the blocks of ``offsets``, in their order (by class)
        by_class: dict[int, list[Block]] = {}
        keep = set(blocks)  # (not dropped with a slab emptied for another size)
        for b in blocks:
            assert b.ns.ssd_cls is not None
            by_class.setdefault(b.ns.ssd_cls.slot_bytes, []).append(b)
        for group in by_class.values():
            cls = group[0].ns.ssd_cls
            assert cls is not None
            pool, policy = self.store.ssd.pool, self.store.ssd.policy(cls)
            members = set(group)

            def allowed(b: Block) -> bool:
                if b.ssd_holds or b in members:
                    return False
                if callable(evict):
                    return evict(b)
                return b.offset is not None or b.kids is None

            while pool.available(cls) < len(group):
                victim = self._clean_victim(policy, allowed) if evict else None
                if victim is None and evict:
                    victim = policy.pop_victim(allowed)
                if (victim is None and (evict is True or isinstance(evict, StopTrades))
                        and empty_ssd_slab(self.store, cls, removed, keep,
                                           evict if isinstance(evict, StopTrades) else None)):
                    continue  # a slab of another size's, emptied: this size's now
                if victim is None:
                    if offsets:
                        self._free_offsets(placed, offsets)
                    # the copies evicted before the room ran out are gone all the same:
                    # withdrawn with the store's other drops, or a restart would bring
                    # back their records, stale (over slots written since), and orphans
                    self.store.dropped_ssd += removed
                    raise CapacityError(
                        f"the ssd tier has no room for {len(group)} blocks of "
                        f"{cls.slot_bytes} bytes")
                if (victim.offset is None and not victim.marks & REMOTE_MARK
                        and self.store.remote_write_back is not None):
                    self.store.counters.ssd_evicted_unwritten += 1  # its last copy goes
                removed.append(self.store.drop_ssd_copy(victim))
                self.store.counters.ssd_evictions += 1
            got = pool.allocate(cls, len(group))
            assert got is not None
            offsets.extend(got)
            placed.extend(group)
        ordered = [b for group in by_class.values() for b in group]
        t = Transfer(next(self.store.ids), SSD, ordered, offsets, [b.demoting for b in ordered])
        self.store.transfers[t.id] = t
        self.store.ssd_reserved_slots += len(offsets)
        for b in ordered:
            if not b.demoting:
                self.store.pin_block(b)   # write-through: keep the DRAM copy while it is read
        return t, removed

    def _free_offsets(self, blocks: list[Block], offsets: list[int]) -> None:
        assert self.store.ssd is not None
        for b, off in zip(blocks, offsets):
            assert b.ns.ssd_cls is not None
            self.store.ssd.pool.free(b.ns.ssd_cls, [off])

    def finish_write(self, t: Transfer, records: list[Any] | None) -> None:
        """The write of a transfer ended: ``records`` per block on success, None on failure.

        Demoted blocks then leave DRAM (or, on failure, or if pinned meanwhile, return to
        its eviction order); written-through blocks keep both copies.  A copy whose bytes
        changed in DRAM since their commit (written through a mapping kept after it) went
        to SSD under a digest of its own, which a restart would hand readers as the
        block's: it is damaged, as a failed read finds it, and goes at once."""
        store = self.store
        del store.transfers[t.id]
        store.ssd_reserved_slots -= len(t.offsets)
        changed = _end_write(store, self.room, t, records)
        for b in changed:  # changed since their commit: damaged (see above)
            self.corrupt(b, store.dropped_ssd)

    def abort_demotion(self, blocks: list[Block]) -> None:
        """Demotion victims that could not be written: back on the DRAM eviction order."""
        self.room.not_demoting(blocks)

    def writeback_plan(self, high: float = 0.75, low: float = 0.5,
                       batch: int = 64) -> list[Block]:
        """Cold blocks to copy to SSD ahead of need: where blocks only in DRAM fill more
        than ``high`` of a class's share of the tier, the oldest down towards ``low``, so
        that eviction finds clean blocks it can drop at once."""
        plan: list[Block] = []
        for cls, dirty in self.store.dirty.items():
            if not dirty:
                continue
            total = next(iter(dirty)).ns.dram.pool.capacity_bytes // cls.slot_bytes
            if len(dirty) <= high * total:
                continue
            want = min(batch, len(dirty) - int(low * total))
            for b in dirty:
                if len(plan) >= want:
                    break
                if b.refs == 0 and not b.demoting and self.store.admitted(b):
                    plan.append(b)
        return plan

    def _clean_victim(self, policy: EvictionPolicy[Block],
                          allowed: Callable[[Block], bool]) -> Block | None:
        """In the remote store's write-back mode, an SSD victim among the coldest few
        that the remote store holds too, taken off the order; None if there is none (or
        no such mode): the plain victim then."""
        if not (isinstance(policy, _ORDERED) and self.store.remote_writing_back()):
            return None
        coldest: Iterator[Block] = policy.coldest()
        for b in itertools.islice(coldest, _CLEAN_VICTIM_REACH):
            if b.marks & REMOTE_MARK and allowed(b):  # (``remote``, without a call)
                policy.remove(b)  # the iteration ends here: no change while it runs
                return b
        return None

    def ssd_write_back_plan(self, max_bytes: int = 16 << 20) -> list[Block]:
        """SSD copies near eviction that the remote store lacks (its write-back mode, where
        the SSD tier is the last local one): in each SSD class with fewer free slots than
        its window (``_SEND_WINDOW_BYTES`` of slots, or an eighth of the class if less,
        but at least twice what eviction looks through for a sent copy), those among
        its coldest window of copies, coldest first, up to ``max_bytes`` and never more
        than half of the class's evictable copies (eviction needs the others).  Their SSD
        copies are held until :meth:`ssd_write_back_done`.  Costs at most a window's walk
        along the eviction order."""
        if self.store.ssd is None or not self.store.remote_writing_back():
            return []
        plan: list[Block] = []
        size = 0
        skip = self.store.remote_skipping()  # (tenants whose share refused values lately)
        for slot_bytes, policy in self.store.ssd.policies.items():
            if not isinstance(policy, _ORDERED):
                continue  # the SSD tier's order is LRU; only an order says what is coldest
            evictable = len(policy)
            free = self.store.ssd.pool.available(self.store.ssd.pool.classes[slot_bytes])
            window = max(2 * _CLEAN_VICTIM_REACH,
                         min(_SEND_WINDOW_BYTES // slot_bytes, (evictable + free) // 8))
            if free >= window:
                continue
            coldest: Iterator[Block] = policy.coldest()
            taken = 0
            for b in itertools.islice(coldest, window - free):
                if size >= max_bytes or taken >= evictable // 2:
                    break
                if not b.marks & REMOTE_MARK and b.ssd_holds == 0 and b.ns.tenant not in skip:
                    plan.append(b)
                    size += b.ns.block_bytes
                    taken += 1
        for b in plan:
            b.ssd_holds += 1
        return plan

    def held_to_send(self, blocks: list[Block]) -> list[Block]:
        """Of write-through blocks the remote store has yet to take, those whose SSD copy
        is the one left to send (DRAM let them go), their SSD copies held until
        :meth:`ssd_write_back_done`."""
        plan = [b for b in blocks if b.offset is None and b.ssd_offset is not None
                and not b.marks & REMOTE_MARK and b.ns.blocks.get(b.key) is b]
        for b in plan:
            b.ssd_holds += 1
        return plan

    def ssd_write_back_done(self, blocks: list[Block], sent: list[bool],
                            unreadable: list[bool], *,
                            write_back: bool = True) -> list[tuple[bytes, bytes]]:
        """The blocks of :meth:`ssd_write_back_plan` (or ``held_to_send``: not
        ``write_back``) were sent (``sent``), or not.  A copy whose read failed
        (``unreadable``) is corrupt on disk and goes, as a failed promotion's does;
        returns the SSD copies dropped, to withdraw from the index."""
        removed: list[tuple[bytes, bytes]] = []
        for b, done, bad in zip(blocks, sent, unreadable):
            b.ssd_holds -= 1
            if done:
                b.remote = True
                self.store.changed(b)
                self.store.counters.remote_writebacks += write_back
            elif bad:
                self.corrupt(b, removed)
            self.store.forget_if_gone(b)
        if self.store.hollow:
            self.store.sweep_hollow()
        return removed

    def write_through_candidates(self, blocks: Iterable[Block]) -> list[Block]:
        """Newly committed blocks the SSD tier should copy now (write-through)."""
        return [b for b in blocks if b.offset is not None and b.ssd_offset is None
                and not b.demoting and self.store.admitted(b) and b.ns.blocks.get(b.key) is b]

    def promotion(self, blocks: list[Block]) -> Plan:
        """The plan that brings SSD-only blocks into DRAM: their reads, into DRAM slots
        reserved here (``promote``), those others are reading already (``reads``), or
        the writes that must make room first."""
        t = self.begin_promotion(blocks)
        if isinstance(t, Plan):
            return t
        mine = set(t.blocks)
        reading = [b for b in dict.fromkeys(blocks) if b.promoting and b not in mine]
        if not t.blocks:
            self.finish_promotion(t, [])
            return Plan(reads=reading)
        return Plan(promote=t, reads=reading)

    def begin_promotion(self, blocks: list[Block]) -> Transfer | Plan:
        """DRAM slots to read SSD-only blocks into (those not being read already); or the
        plan of the writes that must make room first, or CapacityError, nothing taken."""
        todo = [b for b in dict.fromkeys(blocks)
                if b.offset is None and b.ssd_offset is not None and not b.promoting]
        offsets: list[int] = []
        by_ns: dict[Namespace, list[Block]] = {}
        for b in todo:
            by_ns.setdefault(b.ns, []).append(b)
        taken: list[tuple[Namespace, list[int]]] = []
        try:
            for ns, group in by_ns.items():
                got = self.room.allocate(ns, len(group))
                if isinstance(got, Plan):
                    for done_ns, slots in taken:
                        done_ns.dram.give(done_ns, slots)
                    return got
                taken.append((ns, got))
                offsets.extend(got)
        except BaseException:
            for ns, got in taken:
                ns.dram.give(ns, got)
            raise
        ordered = [b for group in by_ns.values() for b in group]
        for b in ordered:
            b.promoting = True
            b.ssd_holds += 1
        t = Transfer(next(self.store.ids), DRAM, ordered, offsets)
        self.store.transfers[t.id] = t
        self.store.reserved_slots += len(offsets)
        self.store.reserved_bytes += sum(b.ns.cls.slot_bytes for b in ordered)
        return t

    def abort_promotion(self, t: Transfer) -> None:
        """A promotion whose reads never began, or failed as a whole (no verdict on any
        copy): its DRAM slots go back, its blocks stay on SSD as they were."""
        del self.store.transfers[t.id]
        self.store.reserved_slots -= len(t.offsets)
        self.store.reserved_bytes -= sum(b.ns.cls.slot_bytes for b in t.blocks)
        for b, off in zip(t.blocks, t.offsets):
            b.promoting = False
            b.ssd_holds -= 1
            b.ns.dram.give(b.ns, [off])
            self.store.forget_if_gone(b)
        if self.store.hollow:
            self.store.sweep_hollow()

    def finish_promotion(self, t: Transfer, ok: list[bool]) -> list[tuple[bytes, bytes]]:
        """Reads ended: good ones become DRAM copies.  A failed one (corrupt on disk) loses
        its SSD copy, and what depends on it goes too unless pinned; returns the SSD
        copies dropped, to withdraw from the index."""
        removed: list[tuple[bytes, bytes]] = []
        del self.store.transfers[t.id]
        self.store.reserved_slots -= len(t.offsets)
        self.store.reserved_bytes -= sum(b.ns.cls.slot_bytes for b in t.blocks)
        failed: list[Block] = []
        for b, off, good in zip(t.blocks, t.offsets, ok):
            b.promoting = False
            b.ssd_holds -= 1
            if good and b.ssd_offset is not None:
                b.offset = off
                b.ns.dram.pool.place(b.ns.cls, (b,))
                self.store.changed(b)
                self.store.committed_slots += 1
                self.store.committed_bytes += b.ns.cls.slot_bytes
                b.ns.dram.policy(b.ns.cls).insert(b)
                self.store.counters.promotions += 1
            else:
                b.ns.dram.give(b.ns, [off])
                if good:
                    self.store.forget_if_gone(b)
                else:
                    failed.append(b)
        for b in failed:  # after the good ones, which may hang below a failed one
            self.corrupt(b, removed)
        self.store.counters.peak_committed = max(self.store.counters.peak_committed, self.store.committed_slots)
        return removed

    def corrupt(self, b: Block, removed: list[tuple[bytes, bytes]]) -> None:
        """A read of the block's SSD copy failed its checksum: the copy goes (unless
        another read holds it), and if that was the block's last copy, what hangs below
        it goes too unless in use; the SSD copies dropped are added to ``removed``."""
        self.store.counters.checksum_failures += 1
        _lose_copy(self.store, b, removed)

    def restore_many(self, ns: Namespace, found: Sequence[Found]) -> list[bool]:
        """Take back the blocks found on SSD at start-up (the SSD index's records), parents
        first, their slots claimed in one go; one bool each, False where one does not fit
        this configuration (as one by one)."""
        return restore_blocks(self.store, ns, list(map(_key, found)),
                              list(map(_parent, found)), list(map(_offset, found)),
                              list(map(_checksum, found)))

    def restore_columns(self, ns: Namespace, keys: list[bytes], parent_back: list[int],
                        offsets: list[int], checksums: list[int]) -> list[bool]:
        """``restore_many`` of records given as columns, distinct keys each parent
        before its children (the SSD index's warm restart reads them so: no object per
        record): ``parent_back`` says how many places back each one's parent is, 0 for a
        root, -1 for a parent not among them (so not restored).  A chain's are all 1,
        an int Python keeps made once, so the list costs a pointer a record."""
        if not ns.blocks:  # nothing there before: parents are found by position alone
            return restore_fresh(self.store, ns, keys, parent_back, offsets, checksums)
        parents = [None if back == 0 else keys[i - back] if back > 0 else _ABSENT
                   for i, back in enumerate(parent_back)]
        return restore_blocks(self.store, ns, keys, parents, offsets, checksums)


_ABSENT = b"absent"  # a parent key no block has (keys are 16 bytes)


def _lose_copy(store: StoreCore, b: Block, removed: list[tuple[bytes, bytes]]) -> None:
    """The block's SSD copy is lost (unless a read holds it, then it stays): if that was
    its last copy, what hangs below it goes too unless in use; the SSD copies dropped are
    added to ``removed``."""
    if b.ssd_offset is not None and b.ssd_holds == 0:
        removed.append(store.drop_ssd_copy(b))
    if not b.present and b.ns.blocks.get(b.key) is b:
        # a hole in the chain: what hangs below it can no longer be found
        store.drop_subtree(b.ns, [b], removed)
    store.forget_if_gone(b)
    if b.ns.blocks.get(b.key) is b and not b.present:
        store.hollow.add(b)  # something below is in use: drop it when released


def _end_write(store: StoreCore, room: RoomMaker, t: Transfer,
               records: list[Any] | None) -> list[Block]:
    """``SsdCopies.finish_write`` over the transfer's blocks, in order: the SSD copies
    made (or their slots freed), the demoted blocks' DRAM copies dropped, the rest back
    on their orders or unpinned; the blocks whose bytes changed since their commit."""
    ssd = store.ssd
    assert ssd is not None
    counters, free, dirty = store.counters, ssd.pool.free, store.dirty
    touch = store.changes.touch if store.changes is not None else None
    order_of: dict[int, EvictionPolicy[Block]] = {}  # SSD orders, by slot size
    changed: list[Block] = []
    # The DRAM copies that go, dropped one by one but given back to their pools and
    # counted out at once (before any unpin below, which may free slots itself: the
    # pools see the frees in the order of the blocks)
    drops = room.drops()
    try:
        for i, (b, off, demote) in enumerate(zip(t.blocks, t.offsets, t.demote)):
            cls = b.ns.ssd_cls
            assert cls is not None
            rare = b.rare
            # a demoted block off its eviction order (``b.demoting`` without a call):
            # the batch drops its DRAM copy below, if written
            batched = demote and not b.refs and rare is not None and rare.demoting
            if records is None or b.ssd_offset is not None:
                free(cls, [off])
            else:
                b.ssd_offset = off
                ssd.pool.place_at(cls, (off,), (b,))
                digest = getattr(records[i], "checksum", 0)
                if not b.checksum:  # the SSD tier's own digest of the bytes it wrote
                    b.checksum = digest
                elif digest and digest != b.checksum:
                    changed.append(b)
                order = order_of.get(cls.slot_bytes)
                if order is None:
                    order = order_of[cls.slot_bytes] = ssd.policy(cls)
                order.insert(b)
                store.ssd_committed_slots += 1
                store.ssd_committed_bytes += cls.slot_bytes
                if dirty:
                    dirty.get(b.ns.cls, {}).pop(b, None)
                counters.ssd_writes += 1
                counters.demotions += demote
                if touch is not None and not batched:  # (``StoreCore.changed``;
                    touch(b)  # the batch's drop marks it, the same for the events)
            if not demote:
                drops.finish()
                store.unpin_block(b)
            elif b.ssd_offset is not None and b.refs == 0:
                if batched:
                    drops.drop(b)
                else:
                    drops.finish()  # (the pools see the frees in order)
                    store.drop_dram_copy(b)
            else:  # the write failed, or a reader pinned it meanwhile: it stays in DRAM
                store.back_on_order(b)
    finally:
        drops.finish()
    return changed


class Found(Protocol):
    """A block found on SSD at start-up: what the SSD tier's index record says of it."""

    @property
    def key(self) -> bytes: ...
    @property
    def parent(self) -> bytes | None: ...
    @property
    def offset(self) -> int: ...
    @property
    def checksum(self) -> int: ...


_key = attrgetter("key")
_parent = attrgetter("parent")
_offset = attrgetter("offset")
_checksum = attrgetter("checksum")


def _placed(store: StoreCore, slot_bytes: int, fresh: list[Block]) -> None:
    """Restored blocks placed on SSD: counted in the tier's figures, and their keys in
    the event stream's filter (restored after the stream began)."""
    store.ssd_committed_slots += len(fresh)
    store.ssd_committed_bytes += len(fresh) * slot_bytes
    if store.key_counts is not None:
        for b in fresh:
            store.key_counts.add(b.key)


def restore_blocks(store: StoreCore, ns: Namespace, keys: list[bytes],
                   parents: list[bytes | None], offsets: list[int],
                   checksums: list[int]) -> list[bool]:
    """``SsdCopies.restore_many`` over its records' columns: one loop over a warm
    restart's blocks, which may be millions, so the map's get and set and the child
    link are inline, and only what fails is written into the answer."""
    ssd = store.ssd
    cls = ns.ssd_cls
    assert ssd is not None and cls is not None
    ok = ssd.pool.claim_many(cls, offsets)
    blocks = ns.blocks
    shards, mask = blocks.shards, blocks.mask
    seen = store.ssd_admit_after
    roots = store.roots
    fresh: list[Block] = []
    add = fresh.append
    given_back: set[int] = set()  # claimed for an entry that could not be restored
    for i, (key, parent, offset, got) in enumerate(zip(keys, parents, offsets, ok)):
        if parent is None:
            parent_block = None
        else:
            parent_block = shards[hash(parent) & mask].get(parent)
        shard = shards[hash(key) & mask]
        if (parent is not None and parent_block is None) or key in shard:
            if got:  # one by one it would not have been claimed: free for those after it
                ssd.pool.free(cls, [offset])
                given_back.add(offset)
                ok[i] = False
            continue
        if not got:  # a slot given back above is claimed again, as one by one
            if offset not in given_back:
                continue
            given_back.discard(offset)
            if not ssd.pool.claim(cls, offset):
                continue
            ok[i] = True
        block = Block(key, ns, parent_block)
        block.ssd_offset = offset
        block.checksum = checksums[i]
        block.marks = seen << SEEN_SHIFT  # (``seen``; a new block's marks are 0)
        if parent_block is not None:
            if parent_block.kids is None:
                parent_block.kids = block
            else:
                parent_block.add_child(block)
        elif roots.setdefault(key, ns) is not ns:
            also_heads(roots, key, ns)
        shard[key] = block
        add(block)
        if not mask and len(shard) > SPLIT_AT:
            blocks.grown()
            shards, mask = blocks.shards, blocks.mask
    ssd.policy(cls).insert_many(fresh)
    ssd.pool.place_at(cls, [b.ssd_offset for b in fresh], fresh)  # type: ignore[misc]
    _placed(store, cls.slot_bytes, fresh)
    return ok


def restore_fresh(store: StoreCore, ns: Namespace, keys: list[bytes],
                  parent_back: list[int], offsets: list[int],
                  checksums: list[int]) -> list[bool]:
    """``restore_blocks`` into a namespace with no blocks yet, of distinct keys whose
    parents are given by position (``SsdCopies.restore_columns``): each one's parent is
    the block made for that position or none, so no key is looked up (the same answer,
    a third less of a warm restart's loop)."""
    ssd = store.ssd
    cls = ns.ssd_cls
    assert ssd is not None and cls is not None and not ns.blocks
    ok = ssd.pool.claim_many(cls, offsets)
    if all(ok) and -1 not in parent_back:  # every one is made (a warm restart's case)
        fresh = _made_fresh(ns, keys, parent_back, offsets, checksums, store.ssd_admit_after,
                            store.roots)
    else:
        fresh = _made_with_gaps(store, ns, keys, parent_back, offsets, checksums, ok)
    ssd.policy(cls).insert_many(fresh)
    ssd.pool.place_at(cls, [b.ssd_offset for b in fresh], fresh)  # type: ignore[misc]
    _placed(store, cls.slot_bytes, fresh)
    return ok


def _made_with_gaps(store: StoreCore, ns: Namespace, keys: list[bytes],
                    parent_back: list[int], offsets: list[int], checksums: list[int],
                    ok: list[bool]) -> list[Block]:
    """``restore_fresh``'s blocks where some slot was not claimed or some parent is not
    among them: made as one by one would (a slot claimed for an entry that cannot be
    restored given back for those after it), ``ok`` set to what was restored."""
    ssd, cls = store.ssd, ns.ssd_cls
    assert ssd is not None and cls is not None
    blocks = ns.blocks
    shards, mask = blocks.shards, blocks.mask
    seen = store.ssd_admit_after
    roots = store.roots
    made: list[Block | None] = []  # by position: its block, or None where none was made
    keep = made.append
    given_back: set[int] = set()  # claimed for an entry that could not be restored
    for i, (key, back, offset, got) in enumerate(zip(keys, parent_back, offsets, ok)):
        parent_block = made[i - back] if back > 0 else None
        if back and parent_block is None:
            if got:  # one by one it would not have been claimed: free for those after it
                ssd.pool.free(cls, [offset])
                given_back.add(offset)
                ok[i] = False
            keep(None)
            continue
        if not got:  # a slot given back above is claimed again, as one by one
            if offset not in given_back:
                keep(None)
                continue
            given_back.discard(offset)
            if not ssd.pool.claim(cls, offset):
                keep(None)
                continue
            ok[i] = True
        block = Block(key, ns, parent_block)
        block.ssd_offset = offset
        block.checksum = checksums[i]
        block.marks = seen << SEEN_SHIFT  # (``seen``; a new block's marks are 0)
        if parent_block is not None:
            if parent_block.kids is None:
                parent_block.kids = block
            else:
                parent_block.add_child(block)
        elif roots.setdefault(key, ns) is not ns:
            also_heads(roots, key, ns)
        shards[hash(key) & mask][key] = block
        keep(block)
        if not mask and len(shards[0]) > SPLIT_AT:
            blocks.grown()
            shards, mask = blocks.shards, blocks.mask
    # (the map was empty: as many in it as positions, and every position has its block)
    return (cast("list[Block]", made) if sum(map(len, shards)) == len(made)
            else [b for b in made if b is not None])


_new_block = Block.__new__
_BLOCK_SLOTS = ("key", "ns", "parent", "kids", "offset", "refs", "ssd_offset", "rare",
                "marks", "checksum", "tokens", "dram_duel", "dram_order", "dram_older",
                "dram_newer", "ssd_order", "ssd_older", "ssd_newer")


def _made_fresh(ns: Namespace, keys: list[bytes], parent_back: list[int],
                offsets: list[int], checksums: list[int], seen: int,
                roots: dict[bytes, Heads]) -> list[Block]:
    """``restore_fresh``'s blocks where every one is made (each slot claimed, each
    parent among them): made, linked to their parents and put in the key map (those
    without a parent in ``roots`` too), in order.

    The one loop of a warm restart that runs a Python step per block, so each step is
    as few as it can be: each entry made by ``Block.__new__`` with its slots stored
    here (``Block.__init__``'s defaults, those restored in place of theirs: a call and
    six stores less a block), its parent the one ``back`` places before it (``made[-back]``:
    no index kept), and the key map split into its shards from the start where it
    will pass the split (each shard then holds its keys in the order inserted, as a
    split later would leave them).  ``_BLOCK_SLOTS`` says which slots these are; a
    check at import holds it to ``Block``'s names, and a test (``test_ssd_fresh_slots``)
    the values to what ``Block.__init__`` gives them."""
    blocks = ns.blocks
    if len(keys) > SPLIT_AT:
        blocks.shards, blocks.mask = [{} for _ in range(SHARDS)], SHARDS - 1
    shards, mask = blocks.shards, blocks.mask
    made: list[Block] = []
    keep = made.append
    new = _new_block
    marks = seen << SEEN_SHIFT  # (``seen``)
    for key, back, offset, checksum in zip(keys, parent_back, offsets, checksums):
        block = new(Block)
        block.key = key
        block.ns = ns
        if back:
            parent = made[-back]
            block.parent = parent
            if parent.kids is None:
                parent.kids = block
            else:
                parent.add_child(block)
        else:
            block.parent = None
            if roots.setdefault(key, ns) is not ns:
                also_heads(roots, key, ns)
        block.kids = None
        block.offset = None
        block.refs = 0
        block.ssd_offset = offset
        block.rare = None
        block.marks = marks
        block.checksum = checksum
        block.tokens = None
        block.dram_duel = None
        block.dram_order = None
        block.dram_older = None
        block.dram_newer = None
        block.ssd_order = None
        block.ssd_older = None
        block.ssd_newer = None
        shards[hash(key) & mask][key] = block
        keep(block)
    if not mask:
        blocks.grown()
    return made


if _BLOCK_SLOTS != Block.__slots__:  # (not an assert: kept under ``python -O``)
    raise ImportError("_made_fresh stores every slot of a Block: its list is out of date")


def tenant_bytes(store: StoreCore) -> dict[str, int]:
    """Bytes of the SSD copies each tenant has on the tier's eviction orders (those not
    being read or written now): what its share (``TenantOrders``) counts.  O(classes x
    tenants)."""
    out: dict[str, int] = {}
    if store.ssd is None:
        return out
    for slot_bytes, policy in store.ssd.policies.items():
        if isinstance(policy, TenantOrders):
            for tenant, count in policy.held().items():
                out[tenant] = out.get(tenant, 0) + count * slot_bytes
    return out
