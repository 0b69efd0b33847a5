"""The store's data model: block entries, namespaces, slots per tier, holdings.

Plain records with no behaviour beyond their own fields: a ``Block`` (one key's entry:
its place in a chain and its copies per tier), a ``Namespace`` (one identity's
blocks), ``TierSlots`` (one tier's slab pool, an eviction order per slab class and the
bytes each tenant holds in it), the reservations, pins and transfers owners hold, and
the store's counters.  Everything else of the store imports this; it imports none of it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Protocol

from kvstore.block_map import BlockMap
from kvstore.identity import Identity
from kvstore.pool import SlabClass, SlabPool
from kvstore.scheduler.admission import SEEN_MOST
from kvstore.scheduler.duel_samples import Backlogs
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.eviction import EvictionPolicy, WarmPins, make_policy
from kvstore.scheduler.tenant_orders import TenantOrders
from kvstore.token_ids import TokenRun

Owner = Hashable
DRAM = "dram"

SSD = "ssd"
LINKED_TIERS = (DRAM, SSD)  # tiers whose LRU orders live in the blocks' own slots


ANNOUNCED = 0xF  # ``Block.marks``: the bits of ``announced``
REMOTE_MARK = 0x10  # and of ``remote``
SEEN_SHIFT = 5  # and ``seen`` above them
SEEN_ONE = 1 << SEEN_SHIFT  # one more ``seen``: ``block.marks += SEEN_ONE``
# ``seen`` stops at SEEN_MOST (``ssd.admit_after`` is at most that, so no more is asked
# of it): the hot paths add SEEN_ONE only while ``marks < SEEN_FULL``, so that ``marks``
# stays at most 255, a cached small int (a hot block's count would make it an int
# object of its own, 32 bytes, from its 8th hit)
SEEN_FULL = SEEN_MOST << SEEN_SHIFT


class _Rare:
    """A block's fields that few blocks set, and those for a while: kept apart so that
    each block pays one slot for them (8 bytes) rather than five (40)."""

    __slots__ = ("ssd_holds", "demoting", "promoting", "gpu_offset", "extra")

    def __init__(self) -> None:
        self.ssd_holds = 0
        self.demoting = False
        self.promoting = False
        self.gpu_offset: int | None = None
        self.extra: dict[str, int] | None = None


class Block:
    """One key's entry: its place in the chain, its copies per tier, its pins."""

    __slots__ = ("key", "ns", "parent", "kids", "offset", "refs", "ssd_offset", "rare",
                 "marks", "checksum", "tokens", "dram_duel",
                 "dram_order", "dram_older", "dram_newer", "ssd_order", "ssd_older", "ssd_newer")

    def __init__(self, key: bytes, ns: Namespace, parent: Block | None) -> None:
        self.key = key
        self.ns = ns
        self.parent = parent
        # The entries that name this one as parent: None, the one child (a chain's common
        # case, no container), or a dict of them in insertion order (a branch point), so
        # that removal walks a subtree, never the namespace.
        self.kids: Block | dict[Block, None] | None = None
        self.offset: int | None = None      # DRAM slot
        self.refs = 0                       # pins on the DRAM copy
        self.ssd_offset: int | None = None  # SSD slot
        # what few blocks have at a time (SSD reads in flight, a move under way, a copy
        # in the GPU or an added tier): the properties below, None while all are unset
        self.rare: _Rare | None = None
        # ``announced`` (bits 0-3), ``remote`` (bit 4) and ``seen`` (the rest) in one
        # slot: 18 slots make an entry of 176 bytes, 19 one of 192 (the allocator rounds
        # to 16), and a value up to 256 (``seen`` stops at 7) is a cached small int, no
        # object of its own
        self.marks = 0
        self.checksum = 0                   # xxh3_64 of the bytes as written (0: unknown);
        # an SSD copy is read back by it (and its offset, key and namespace's sizes)
        self.tokens: TokenRun | None = None  # its commit's token ids, while events are on
        # its state in the DRAM class's duel (``auto``), None while not tracked: there
        # rather than in a map of every tracked block (``kvstore.scheduler.tracked``)
        self.dram_duel: bool | int | None = None
        # Its place in its DRAM and its SSD class's LRU order, which lives in the blocks
        # (``LinkedOrder``: no table to grow, 24 bytes a block rather than 91).
        self.dram_order: object = None
        self.dram_older: Block | None = None
        self.dram_newer: Block | None = None
        self.ssd_order: object = None
        self.ssd_older: Block | None = None
        self.ssd_newer: Block | None = None

    def _rare(self) -> _Rare:
        rare = self.rare
        if rare is None:
            rare = self.rare = _Rare()
        return rare

    def _settle(self, rare: _Rare) -> None:
        """Drop the side record once every field in it is back to its default."""
        if (not rare.ssd_holds and not rare.demoting and not rare.promoting
                and rare.gpu_offset is None and rare.extra is None):
            self.rare = None

    @property
    def ssd_holds(self) -> int:
        """Reads of the SSD copy in flight."""
        rare = self.rare
        return 0 if rare is None else rare.ssd_holds

    @ssd_holds.setter
    def ssd_holds(self, value: int) -> None:
        if value or self.rare is not None:
            rare = self._rare()
            rare.ssd_holds = value
            self._settle(rare)

    @property
    def demoting(self) -> bool:
        """The DRAM copy is being written back, then dropped."""
        rare = self.rare
        return False if rare is None else rare.demoting

    @demoting.setter
    def demoting(self, value: bool) -> None:
        if value or self.rare is not None:
            rare = self._rare()
            rare.demoting = value
            self._settle(rare)

    @property
    def promoting(self) -> bool:
        """The DRAM copy is being read in from SSD."""
        rare = self.rare
        return False if rare is None else rare.promoting

    @promoting.setter
    def promoting(self, value: bool) -> None:
        if value or self.rare is not None:
            rare = self._rare()
            rare.promoting = value
            self._settle(rare)

    @property
    def gpu_offset(self) -> int | None:
        """A copy in the GPU tier's device pool."""
        rare = self.rare
        return None if rare is None else rare.gpu_offset

    @gpu_offset.setter
    def gpu_offset(self, value: int | None) -> None:
        if value is not None or self.rare is not None:
            rare = self._rare()
            rare.gpu_offset = value
            self._settle(rare)

    @property
    def extra(self) -> dict[str, int] | None:
        """Copies in added tiers: name -> slot."""
        rare = self.rare
        return None if rare is None else rare.extra

    @extra.setter
    def extra(self, value: dict[str, int] | None) -> None:
        if value is not None or self.rare is not None:
            rare = self._rare()
            rare.extra = value
            self._settle(rare)

    @property
    def announced(self) -> int:
        """The tiers the event stream announced it in (``tier_changes.TIER_BITS``)."""
        return self.marks & ANNOUNCED

    @announced.setter
    def announced(self, bits: int) -> None:
        assert not bits & ~ANNOUNCED, f"announced bits {bits:#x} out of range"
        self.marks = self.marks & ~ANNOUNCED | bits

    @property
    def seen(self) -> int:
        """Commits and hits up to SEEN_MOST, for the SSD admission filter (the hot
        paths add ``SEEN_ONE`` to ``marks`` themselves while below ``SEEN_FULL``)."""
        return self.marks >> SEEN_SHIFT

    @seen.setter
    def seen(self, count: int) -> None:
        self.marks = self.marks & (SEEN_ONE - 1) | min(count, SEEN_MOST) << SEEN_SHIFT

    @property
    def remote(self) -> bool:
        """Known to be in the remote store."""
        return bool(self.marks & REMOTE_MARK)

    @remote.setter
    def remote(self, value: bool) -> None:
        self.marks = self.marks | REMOTE_MARK if value else self.marks & ~REMOTE_MARK

    # Hashed and compared by identity (in C: the orders, sets and dicts of blocks cost
    # no Python call per step); the eviction orders' ghost lists name a block by its key
    # (``block_key``), so that one cached again after it left is the one remembered.

    @property
    def children(self) -> int:
        """How many entries name this one as parent."""
        kids = self.kids
        return 0 if kids is None else len(kids) if isinstance(kids, dict) else 1

    def child_list(self) -> list[Block]:
        """The entries that name this one as parent."""
        kids = self.kids
        return [] if kids is None else list(kids) if isinstance(kids, dict) else [kids]

    def add_child(self, child: Block) -> None:
        kids = self.kids
        if kids is None:
            self.kids = child
        elif isinstance(kids, dict):
            kids[child] = None
        else:
            self.kids = {kids: None, child: None}

    def remove_child(self, child: Block) -> None:
        kids = self.kids
        if kids is child:
            self.kids = None
        elif isinstance(kids, dict):
            del kids[child]
            if len(kids) == 1:
                self.kids = next(iter(kids))
        else:
            raise AssertionError(f"{child} is no child of {self}")

    @property
    def present(self) -> bool:
        # (``extra`` read from the side record, not through its property: each victim
        # that leaves the cache, and its parent, asks this)
        rare = self.rare
        return (self.offset is not None or self.ssd_offset is not None
                or (rare is not None and rare.extra is not None))

    @property
    def tier(self) -> str:
        """The fastest tier with a copy (of a present block)."""
        if self.offset is not None:
            return DRAM
        if self.ssd_offset is not None or self.extra is None:
            return SSD
        return next(iter(self.extra))

    def __repr__(self) -> str:
        return (f"Block({self.key.hex()[:12]}, dram={self.offset}, ssd={self.ssd_offset}, "
                f"refs={self.refs}, children={self.children})")

block_key = attrgetter("key")  # what the eviction orders remember a block by (its key)
_tenant_of = attrgetter("ns.tenant")  # (``TenantOrders``: the tenant whose order holds it)
# a key's hash for the duel's sample: its digest's bytes, the same in every process (a
# replay samples the blocks it sampled before; ``hash`` of bytes is seeded per process)
key_hash: Callable[[bytes], int] = partial(int.from_bytes, byteorder="little")


class Namespace:
    """One identity's blocks in the daemon."""

    def __init__(self, identity: Identity, dram: TierSlots, cls: SlabClass,
                 ssd_cls: SlabClass | None) -> None:
        self.identity = identity
        self.dram = dram  # the DRAM tier (arena) this namespace's blocks live in
        self.id = identity.namespace_id
        self.tenant = identity.tenant
        self.block_bytes = identity.block_bytes
        self.cls = cls
        self.ssd_cls = ssd_cls
        self.blocks: BlockMap[Block] = BlockMap()  # key -> entry, grown a shard at a time
        # sessions that have it open and reservations in it: with no entry either, the
        # store forgets it (``forget_if_unused``): what a tenant cannot use costs nothing
        self.users = 0
        self.forgotten = False  # forgotten by the store: no reservation is made in it
        # keys an open reservation holds a slot for, not yet committed -> the one that
        # holds it (a list where several do: ``writers``): a reserve with ``skip_held``
        # gives them none (``Reservation.awaited``).  One reservation, no list: a list a
        # key made every reserve and commit about 15% dearer
        self.pending: dict[bytes, Reservation | list[Reservation]] = {}

    def __repr__(self) -> str:
        return f"Namespace({self.identity.model}, tenant={self.tenant}, blocks={len(self.blocks)})"

@dataclass
class Counters:
    lookups: int = 0
    lookup_keys: int = 0
    hit_blocks: int = 0
    committed_blocks: int = 0
    duplicate_blocks: int = 0
    evictions: int = 0
    reservations: int = 0
    aborts: int = 0
    lease_expiries: int = 0
    capacity_rejects: int = 0
    acquires: int = 0
    peak_committed: int = 0
    ssd_hits: int = 0
    ssd_evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    ssd_writes: int = 0
    checksum_failures: int = 0
    dropped_on_eviction: int = 0
    remote_writebacks: int = 0
    ssd_evicted_unwritten: int = 0  # SSD-only copies evicted that the remote store lacked
    slab_moves: int = 0  # DRAM slabs handed from one block size's class to another's
    slab_moved_blocks: int = 0  # blocks copied into their class's other slabs for that
    slab_turns: int = 0  # turns of the loop a request needing several slabs let others have
    ssd_slab_moves: int = 0  # SSD slabs emptied for a size that had none to evict from
    ssd_slab_dropped: int = 0  # SSD copies dropped to empty them
    awaited_keys: int = 0  # keys reserved with no slot: pending in another reservation
    awaited_dropped: int = 0  # keys a commit did not store: an awaited key not cached
    commits_waited: int = 0  # commits that waited for older writers of their keys
    commit_wait_timeouts: int = 0  # of those, ended by the bound, not by the writers
    commit_wait_cycles: int = 0  # waits that would close a cycle: one commit went on

class TierSlots:
    """One tier's slab pool and an eviction order per slab class."""

    def __init__(self, name: str, capacity: int, slab_bytes: int, alignment: int,
                 policy: str, clock: Callable[[], float] | None = None,
                 backlogs: Backlogs | None = None,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        self.name = name
        # False once the tier's files are gone (the SSD tier's directory removed under the
        # daemon): its copies are being dropped (``ssd_lost``), and none may be read
        self.readable = True
        # given: each class's order is one per tenant, the victim from the tenant furthest
        # over its weighted share (``TenantOrders``: the SSD tier's, one for all tenants)
        self.tenant_weights = tenant_weights
        self.pool = SlabPool(capacity, slab_bytes, alignment)
        self.policy_name = policy
        self.clock = clock  # set: orders support soft pins (kept warm until a time)
        self.backlogs = backlogs  # set: a duel's sampled references may wait (its docs)
        self.policies: dict[int, EvictionPolicy[Block]] = {}
        self.used: dict[str, int] = {}  # bytes of slots each tenant holds (any state)
        self.pinned: dict[str, int] = {}  # bytes of those pinned (DRAM copies with refs)
        # bytes each class (by slot size) used lately, slots taken and DRAM hits, halved
        # whenever twice the capacity was used: the classes' shares of the slabs
        # (``kvstore.slab_moves``)
        self.demand: dict[int, float] = {}
        self._demand_since = 0

    def note_use(self, cls: SlabClass, count: int) -> None:
        """``count`` slots of ``cls`` used (taken, or hit in DRAM)."""
        nbytes = count * cls.slot_bytes
        demand = self.demand
        demand[cls.slot_bytes] = demand.get(cls.slot_bytes, 0.0) + nbytes
        self._demand_since += nbytes
        if self._demand_since > 2 * self.pool.capacity_bytes:
            self._demand_since = 0
            for size in demand:
                demand[size] /= 2

    def take(self, ns: Namespace, count: int) -> list[int] | None:
        """``count`` slots of ``ns``'s class, charged to its tenant; None if too few free."""
        offsets = self.pool.allocate(ns.cls, count)
        if offsets is not None and count:
            self.used[ns.tenant] = self.used.get(ns.tenant, 0) + count * ns.cls.slot_bytes
        return offsets

    def give(self, ns: Namespace, offsets: list[int]) -> None:
        """Free slots of ``ns``'s class that its tenant held."""
        if not offsets:
            return
        self.pool.free(ns.cls, offsets)
        left = self.used[ns.tenant] - len(offsets) * ns.cls.slot_bytes
        assert left >= 0, f"tenant {ns.tenant!r} gave back more than it held"
        if left:
            self.used[ns.tenant] = left
        else:
            del self.used[ns.tenant]

    def class_for(self, block_bytes: int) -> SlabClass:
        cls = self.pool.class_for(block_bytes)
        if cls.slot_bytes not in self.policies:
            self.policies[cls.slot_bytes] = self.new_policy(cls.slot_bytes)
        return cls

    def new_policy(self, slot_bytes: int) -> EvictionPolicy[Block]:
        """An empty order of this tier's policy for blocks of ``slot_bytes`` slots, told
        how many the tier holds at most (ghosts named by key; warm pins kept where the
        tier has a clock; one per tenant where the tier has tenants' weights)."""
        if self.tenant_weights is not None:
            orders: TenantOrders[Block] = TenantOrders(
                _tenant_of, partial(self._one_policy, slot_bytes), self.tenant_weights)
            orders.expect(self.pool.capacity_bytes // slot_bytes)
            return orders
        return self._one_policy(slot_bytes)

    def _one_policy(self, slot_bytes: int) -> EvictionPolicy[Block]:
        policy: EvictionPolicy[Block] = make_policy(  # type: ignore[assignment]
            self.policy_name, ghost_key=block_key, name_hash=key_hash,
            links=self.name if self.name in LINKED_TIERS else None)
        policy.expect(self.pool.capacity_bytes // slot_bytes)
        if self.backlogs is not None and isinstance(policy, Duel):
            policy.defer_to(self.backlogs)
        if self.clock is not None:
            policy = WarmPins(policy, self.clock)
        return policy

    def policy(self, cls: SlabClass) -> EvictionPolicy[Block]:
        return self.policies[cls.slot_bytes]

class Skips(Protocol):
    """What a reserve request asks to skip (``protocol.Reserve``, ``ReserveBatch``)."""

    skip_held: bool
    skip_pending: bool


class Skip:
    """The keys a reserve gives no slot (``BlockStore.reserve``): bits of an int (an
    ``enum.IntFlag``'s operations cost a reserve about 1.6 us, 9% of one of a block)."""

    NONE = 0
    HELD = 1  # committed in DRAM: pinned till the commit, a duplicate there
    # given a slot by another open reservation of the namespace: its bytes are coming
    # (not for a put: it commits at once, before that reservation can)
    PENDING = 2
    BOTH = HELD | PENDING

    @staticmethod
    def asked(req: Skips) -> int:
        """A reserve's ``skip_held`` and ``skip_pending`` (this one only with the other:
        an older client sends ``skip_held`` alone, and reads no dropped keys)."""
        if not req.skip_held:
            return Skip.NONE
        return Skip.BOTH if req.skip_pending else Skip.HELD

    @staticmethod
    def of(skip: bool | int) -> int:
        """A request's ``skip_held`` (True: both) or bits as they are."""
        if skip is True:
            return Skip.BOTH
        return Skip.NONE if skip is False else skip


@dataclass(eq=False)
class Reservation:
    id: int
    owner: Owner
    ns: Namespace
    keys: list[bytes]
    parent: Block | None
    offsets: list[int]  # the slots taken, one per key given one, in the keys' order
    parent_pinned: bool = False  # the parent's DRAM copy is pinned (else its SSD copy held)
    # keys (by position) whose blocks were committed in DRAM already: their copies are
    # pinned till the commit (a duplicate each) or the rollback, and they take no slot
    held: dict[int, Block] = field(default_factory=dict)
    # keys (by position) another session's open reservation of the namespace held a slot
    # for at the reserve (``Namespace.pending``): they take no slot either, that one's
    # bytes count.  A commit waits for the reservations that hold them (``awaits``, the
    # daemon's ``CommitWaits``); one that commits such a key pins its block here, which
    # moves the key to ``held``; a key still awaited at the commit must be cached by
    # then, or it and the keys after it are not stored (``BlockStore.commit``)
    awaited: set[int] = field(default_factory=set)
    # the open reservations, all older than this one, holding a slot for an ``awaited``
    # key; and those that await one of this one's keys (the links both ways)
    awaits: set[Reservation] = field(default_factory=set, repr=False)
    awaited_by: set[Reservation] = field(default_factory=set, repr=False)
    # called when ``awaits`` empties or this reservation ends (committed or rolled
    # back), set while its commit waits: in the middle of a store's change, so it only
    # schedules (the daemon resolves a future)
    wake: Callable[[], None] | None = field(default=None, repr=False)
    # the writer's tenant where it is not the namespace's (a ``shared_writers`` grantee):
    # none awaits this one but its own tenant's (``trusts``)
    grantee: str | None = None
    # its session let a commit wait out the bound for one of its reservations lately
    # (``OwnerState.overdue_until``): no reserve awaits this one (``trusts``)
    overdue: bool = False

    def slots(self) -> list[int]:
        """Each key's slot, -1 for a key ``held`` or ``awaited`` (as the reserve reply
        lists them)."""
        if not self.held and not self.awaited:
            return self.offsets
        taken = iter(self.offsets)
        return [-1 if i in self.held or i in self.awaited else next(taken)
                for i in range(len(self.keys))]

    def slotted_keys(self) -> list[bytes]:
        """The keys given a slot, in order: those ``Namespace.pending`` lists it for."""
        if not self.held and not self.awaited:
            return self.keys
        return [k for i, k in enumerate(self.keys) if i not in self.held
                and i not in self.awaited]


def writers(held: Reservation | list[Reservation]) -> list[Reservation]:
    """The reservations a ``Namespace.pending`` entry names."""
    return held if isinstance(held, list) else [held]


def trusts(grantee: str | None, writer: Reservation) -> bool:
    """Whether a reservation of a writer of tenant ``grantee`` (None: the namespace's
    own) awaits ``writer``'s bytes: the namespace owner's, or its own tenant's.  Another
    tenant's open reservation held each of the owner's commits the whole bound, and
    dropped its blocks if never committed: no tenant may stall another's writes so.
    Nor one ``overdue``: a writer holding its reservations open stalled every peer's
    commit the whole bound, for as long as its session lived."""
    return not writer.overdue and (writer.grantee is None or writer.grantee == grantee)


def pend(r: Reservation) -> None:
    """``r`` opened: it awaits the reservations holding a slot for its ``awaited`` keys,
    and its keys given a slot are pending in its namespace."""
    pending = r.ns.pending
    for i in r.awaited:
        r.awaits.update(w for w in writers(pending[r.keys[i]]) if trusts(r.grantee, w))
    for other in r.awaits:
        other.awaited_by.add(r)
    keys = r.slotted_keys()
    if pending.keys().isdisjoint(keys):  # the common case, in C: no other writer
        mine = dict.fromkeys(keys, r)
        if len(mine) == len(keys):  # (else a key twice: one entry each time, below)
            pending.update(mine)
            return
    for key in keys:
        held = pending.get(key)
        if held is None:
            pending[key] = r
        elif isinstance(held, list):
            held.append(r)
        else:
            pending[key] = [held, r]


def unpend(r: Reservation) -> list[Reservation]:
    """``r`` ended (committed or rolled back): its keys are pending no more by it, and
    those awaiting it (returned) await it no more; each left awaiting none, and ``r``
    itself, is woken (``Reservation.wake``)."""
    pending = r.ns.pending
    for key in r.slotted_keys():
        held = pending[key]
        if held is r:
            del pending[key]
        else:
            assert isinstance(held, list), f"{key.hex()} pending in another reservation"
            held.remove(r)
            if len(held) == 1:
                pending[key] = held[0]
    for other in r.awaits:
        other.awaited_by.discard(r)
    r.awaits.clear()
    waiting = unawait(r)
    if r.wake is not None:
        r.wake()
    return waiting

def unawait(r: Reservation) -> list[Reservation]:
    """The reservations awaiting ``r`` (returned) await it no more; each left awaiting
    none is woken (``Reservation.wake``)."""
    waiting, r.awaited_by = list(r.awaited_by), set()
    for other in waiting:
        other.awaits.discard(r)
        if not other.awaits and other.wake is not None:
            other.wake()
    return waiting


def still_awaits(r: Reservation) -> None:
    """Some of ``r``'s awaited keys were stored and are held for it now: it awaits only
    the writers still holding a slot for one of those left, and is woken if none is
    left.  A key pending in two writers was awaited from both: once one had stored it,
    the commit still waited for the other, the whole bound where that one never came."""
    pending = r.ns.pending
    left = {w for i in r.awaited for w in writers(pending.get(r.keys[i], []))} & r.awaits
    for other in r.awaits - left:
        other.awaited_by.discard(r)
    r.awaits = left
    if not left and r.wake is not None:
        r.wake()


@dataclass(eq=False)
class Pin:
    id: int
    owner: Owner
    blocks: list[Block]

    @property
    def offsets(self) -> list[int]:
        """The pinned blocks' DRAM slots (a pinned block always has one)."""
        return [b.offset for b in self.blocks if b.offset is not None]

    @property
    def checksums(self) -> list[int]:
        return [b.checksum for b in self.blocks]

@dataclass(eq=False)
class Transfer:
    """Slots held in one tier while bytes move into them (promotion, write to SSD)."""

    id: int
    tier: str
    blocks: list[Block]
    offsets: list[int]
    demote: list[bool] = field(default_factory=list)  # SSD writes: demotion, or write-through

@dataclass(eq=False)
class OwnerState:
    """What one session holds, for limits and for rollback when it goes."""

    deadline: float
    reservations: dict[int, Reservation] = field(default_factory=dict)
    pins: dict[int, Pin] = field(default_factory=dict)
    # slots held by those reservations, and blocks they hold (``Reservation.held``), by
    # the tenant owning their namespace (a grantee's share counts what it reserves in
    # another's: ``Sessions.check_grant_reserve``)
    reserved_in: dict[str, int] = field(default_factory=dict)
    # till when its reservations are ``Reservation.overdue``: a commit waited out the
    # bound for one of them (``Leases.overdue``)
    overdue_until: float = 0.0

def reserved_out(state: OwnerState, r: Reservation) -> None:
    """``r`` is no longer open (committed, aborted, rolled back): its slots leave
    ``state.reserved_in``.  A reservation of no keys holds nothing there (``reserve`` keeps
    no entry for it): counted as 0, its end deleted the entry of another one still open,
    whose own end then found none (an ``internal`` error for an abort)."""
    taken = len(r.keys)  # (a slot, a block held or a key awaited each: as ``reserve``)
    if not taken:
        return
    left = state.reserved_in[r.ns.tenant] - taken
    if left:
        state.reserved_in[r.ns.tenant] = left
    else:
        del state.reserved_in[r.ns.tenant]


@dataclass(frozen=True)
class Limits:
    lease_seconds: float = 30.0
    max_reservations_per_owner: int = 1024
    max_pins_per_owner: int = 4096

@dataclass(frozen=True)
class CommitResult:
    created: int
    duplicates: int
    blocks: list[Block]
    # the keys not stored, from the first ``awaited`` key not cached at the commit on
    dropped: int = 0


def parents_first(ns: Namespace) -> list[Block]:
    """Every block of ``ns``, each after its parent (the key map lists them in no chain
    order)."""
    done: set[int] = set()
    order: list[Block] = []
    for b in ns.blocks.values():
        path = []
        while b is not None and id(b) not in done:
            path.append(b)
            b = b.parent  # type: ignore[assignment]
        for x in reversed(path):
            done.add(id(x))
            order.append(x)
    return order


def subtree(root: Block) -> list[Block]:
    """``root`` and every block below it, along the child links, each after its parent."""
    out: list[Block] = []
    stack = [root]
    while stack:
        b = stack.pop()
        out.append(b)
        kids = b.kids
        if isinstance(kids, Block):
            stack.append(kids)
        elif kids is not None:
            stack.extend(kids)
    return out
