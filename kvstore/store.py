"""The block store: namespaces, the key index, reservations, pins, leases and tiers.

Pure bookkeeping over slot offsets: no sockets, files or event loop.  The daemon owns
the bytes (the DRAM arena, the SSD files) and asks the store where they go.  Every
public method checks before it mutates, so a failed call leaves nothing behind.

A key has one ``Block`` entry, which holds up to one copy per tier: a DRAM slot
(``offset``) and an SSD slot (``ssd_offset``).  In each tier a slot is free, reserved
(held by a reservation, a promotion or a write to SSD that has not finished) or
committed (holds a copy).  ``refs`` counts the pins on the DRAM copy; a pinned copy is
never evicted, moved or reused.

Prefix closure: a copy is only dropped if the block keeps another copy or nothing cached
depends on it (leaf first), so a cached key implies its whole prefix is cached.  An
entry that lost its last copy to corruption stays as a hollow parent of what depends on
it (lookup stops there) until its children are gone.

When the DRAM tier is full and an SSD tier exists, a cold block that is only in DRAM is
demoted (written back) rather than lost: allocation raises ``DemotionNeeded`` with the
victims, the daemon writes them to SSD and calls ``finish_demotion``, then allocates
again.  A block only on SSD is promoted the same way: ``acquire`` raises
``PromotionNeeded``, the daemon reads the copies into DRAM slots from
``begin_promotion`` and reports with ``finish_promotion``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvstore.errors import (
    CapacityError,
    LeaseExpiredError,
    LimitExceededError,
    NotFoundError,
)
from kvstore.gpu_copies import GpuCopies
from kvstore.identity import Identity
from kvstore.pool import SlabClass, SlabPool
from kvstore.scheduler.eviction import EvictionPolicy, LRUPolicy, WarmPins, make_policy

Owner = Hashable
DRAM = "dram"
SSD = "ssd"
_CLEAN_VICTIM_REACH = 64  # SSD copies looked at for one the remote store also holds
_SEND_WINDOW_BYTES = 256 << 20  # the coldest SSD copies kept sent remotely (write-back)


class Block:
    """One key's entry: its place in the chain, its copies per tier, its pins."""

    __slots__ = ("key", "ns", "parent", "children", "offset", "refs", "ssd_offset",
                 "ssd_record", "ssd_holds", "demoting", "promoting", "seen", "remote",
                 "checksum", "gpu_offset", "_hash")

    def __init__(self, key: bytes, ns: Namespace, parent: Block | None) -> None:
        self.key = key
        # Equal by namespace and key, so that a block cached again after eviction is the
        # same item to the eviction orders: their ghost lists (S3-FIFO, ARC) remember it.
        self._hash = hash((ns.id, key))
        self.ns = ns
        self.parent = parent
        self.children = 0
        self.offset: int | None = None      # DRAM slot
        self.refs = 0                       # pins on the DRAM copy
        self.ssd_offset: int | None = None  # SSD slot
        self.ssd_record: Any = None         # what the SSD tier needs to read it back
        self.ssd_holds = 0                  # reads of the SSD copy in flight
        self.demoting = False               # DRAM copy being written back, then dropped
        self.promoting = False              # DRAM copy being read in from SSD
        self.seen = 0                       # commits and hits, for the SSD admission filter
        self.remote = False                 # known to be in the remote store
        self.checksum = 0                   # xxh3_64 of the bytes as written (0: unknown)
        self.gpu_offset: int | None = None  # a copy in the GPU tier's device pool

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Block) and self.key == other.key
                                 and self.ns is other.ns)

    @property
    def present(self) -> bool:
        return self.offset is not None or self.ssd_offset is not None

    @property
    def tier(self) -> str:
        return DRAM if self.offset is not None else SSD

    def __repr__(self) -> str:
        return (f"Block({self.key.hex()[:12]}, dram={self.offset}, ssd={self.ssd_offset}, "
                f"refs={self.refs}, children={self.children})")


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
        self.blocks: dict[bytes, Block] = {}

    def __repr__(self) -> str:
        return f"Namespace({self.identity.model}, tenant={self.tenant}, blocks={len(self.blocks)})"


class DemotionNeeded(Exception):
    """Not an error: DRAM slots free up only after these blocks are written to SSD (and
    those of ``remote`` to the remote store, in its write-back mode).  With neither, room
    is on its way from writes already under way: wait a little, then retry."""

    def __init__(self, blocks: list[Block], remote: list[Block] | None = None) -> None:
        super().__init__(f"{len(blocks)} blocks to demote first")
        self.blocks = blocks
        self.remote = remote or []


class PromotionNeeded(Exception):
    """Not an error: these blocks are only on SSD and must be read into DRAM first."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(f"{len(blocks)} blocks to promote first")
        self.blocks = blocks


@dataclass(eq=False)
class Reservation:
    id: int
    owner: Owner
    ns: Namespace
    keys: list[bytes]
    parent: Block | None
    offsets: list[int]
    parent_pinned: bool = False  # the parent's DRAM copy is pinned (else its SSD copy held)


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


class TierSlots:
    """One tier's slab pool and an eviction order per slab class."""

    def __init__(self, name: str, capacity: int, slab_bytes: int, alignment: int,
                 policy: str, clock: Callable[[], float] | None = None) -> None:
        self.name = name
        self.pool = SlabPool(capacity, slab_bytes, alignment)
        self.policy_name = policy
        self.clock = clock  # set: orders support soft pins (kept warm until a time)
        self.policies: dict[int, EvictionPolicy[Block]] = {}
        self.used: dict[str, int] = {}  # bytes of slots each tenant holds (any state)
        self.pinned: dict[str, int] = {}  # bytes of those pinned (DRAM copies with refs)

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
            policy: EvictionPolicy[Block] = make_policy(self.policy_name)  # type: ignore[assignment]
            if self.clock is not None:
                policy = WarmPins(policy, self.clock)
            self.policies[cls.slot_bytes] = policy
        return cls

    def policy(self, cls: SlabClass) -> EvictionPolicy[Block]:
        return self.policies[cls.slot_bytes]


class BlockStore:
    """Namespaces and blocks in a DRAM tier and an optional SSD tier below it."""

    tier = DRAM

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        *,
        limits: Limits = Limits(),
        eviction_policy: str = "lru",
        alignment: int = 4096,
        per_tenant: bool = False,
        clock: Callable[[], float] = time.monotonic,
        ssd_capacity: int = 0,
        ssd_slab_bytes: int = 256 << 20,
        ssd_admit_after: int = 1,
        tenant_quota: int = 0,
        tenant_weights: Mapping[str, float] | None = None,
        gpu_capacity: int = 0,
        gpu_slab_bytes: int = 64 << 20,
    ) -> None:
        self._dram_args = (capacity_bytes, slab_bytes, alignment, eviction_policy)
        self.tenant_quota = tenant_quota  # most bytes of a shared DRAM tier one tenant holds
        self.tenant_weights = dict(tenant_weights or {})  # shares under pressure (default 1)
        self.clock = clock
        self.per_tenant = per_tenant
        self.drams: dict[str, TierSlots] = {}  # one DRAM tier (arena) per tenant, or one for all
        self.ssd = (TierSlots(SSD, ssd_capacity, ssd_slab_bytes, 4096, "lru")
                    if ssd_capacity else None)
        self.ssd_admit_after = ssd_admit_after
        self.gpu = GpuCopies(gpu_capacity, gpu_slab_bytes) if gpu_capacity else None
        self.ssd_writable = True  # off for a while after the SSD tier failed a write
        # Remote write-back: whether the remote store takes blocks now (None: write-through
        # or no remote tier).  DRAM-only blocks it lacks are written there before eviction.
        self.remote_write_back: Callable[[], bool] | None = None
        self.remote_demoting: set[Block] = set()
        self.allow_evict = True   # the pressure policy's steps: drop cold blocks,
        self.allow_demote = True  # move cold blocks down to SSD
        self._hollow: set[Block] = set()  # lost their last copy; kept for what is in use below
        self._dirty: dict[SlabClass, dict[Block, None]] = {}  # per DRAM class: DRAM-only, oldest first
        self.dropped_ssd: list[tuple[bytes, bytes]] = []  # SSD copies dropped by sweeps
        self.limits = limits
        self.namespaces: dict[bytes, Namespace] = {}
        self.owners: dict[Owner, OwnerState] = {}
        self.transfers: dict[int, Transfer] = {}
        self.counters = Counters()
        self._ids = itertools.count(1)
        self.reserved_slots = 0      # DRAM slots held by reservations and promotions
        self.committed_slots = 0     # DRAM copies
        self.ssd_reserved_slots = 0
        self.ssd_committed_slots = 0

    # -- namespaces and owners ----------------------------------------------------------
    def open_namespace(self, identity: Identity) -> Namespace:
        ns = self.namespaces.get(identity.namespace_id)
        if ns is None:
            dram = self.dram_for(identity.tenant)
            cls = dram.class_for(identity.block_bytes)
            ssd_cls = self.ssd.class_for(identity.block_bytes) if self.ssd else None
            ns = Namespace(identity, dram, cls, ssd_cls)
            self.namespaces[identity.namespace_id] = ns
        return ns

    def available_slots(self, ns: Namespace) -> int:
        """DRAM slots a reservation in ``ns`` could have now: free, or evictable."""
        return ns.dram.pool.available(ns.cls) + len(ns.dram.policy(ns.cls))

    def keep_warm(self, ns: Namespace, keys: Sequence[bytes], until: float) -> int:
        """Soft-pin the DRAM copies of ``keys`` until ``until``: eviction takes them last."""
        policy = ns.dram.policy(ns.cls)
        count = 0
        for key in keys:
            block = ns.blocks.get(key)
            if block is not None and block.offset is not None and not block.demoting \
                    and isinstance(policy, WarmPins):
                policy.pin_soft(block, until)
                count += 1
        return count

    def arena_of(self, tenant: str) -> str:
        """The name of the DRAM arena a tenant's blocks live in ("" when shared by all)."""
        return tenant if self.per_tenant else ""

    def dram_for(self, tenant: str) -> TierSlots:
        name = self.arena_of(tenant)
        tier = self.drams.get(name)
        if tier is None:
            tier = self.drams[name] = TierSlots(DRAM, *self._dram_args, clock=self.clock)
        return tier

    def touch_owner(self, owner: Owner, now: float) -> OwnerState:
        """Renew an owner's lease, which its reservations and pins share."""
        state = self.owners.get(owner)
        deadline = now + self.limits.lease_seconds
        if state is None:
            state = self.owners[owner] = OwnerState(deadline)
        else:  # never earlier: the daemon's own owners hold leases that never end
            state.deadline = max(state.deadline, deadline)
        return state

    def drop_owner(self, owner: Owner) -> tuple[int, int]:
        """Roll back everything an owner holds; returns (reservations, pins) dropped."""
        state = self.owners.pop(owner, None)
        if state is None:
            return 0, 0
        for r in list(state.reservations.values()):
            self._rollback(state, r)
        for pin in list(state.pins.values()):
            self._unpin(state, pin)
        return len(state.reservations), len(state.pins)

    def expire(self, now: float) -> list[Owner]:
        """Roll back the holdings of owners whose lease ran out; returns them."""
        gone = [o for o, s in self.owners.items() if s.deadline <= now]
        for owner in gone:
            state = self.owners[owner]
            self.counters.lease_expiries += len(state.reservations) + len(state.pins)
            self.drop_owner(owner)
        return gone

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading cached key (its length is the hit count)."""
        blocks = ns.blocks
        chain: list[Block] = []
        for key in keys:
            block = blocks.get(key)
            if block is None or not block.present:
                break
            chain.append(block)
        c = self.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        c.hit_blocks += len(chain)
        c.ssd_hits += sum(1 for b in chain if b.offset is None)
        self._access(chain)
        return [b.tier for b in chain]

    def _access(self, chain: list[Block]) -> None:
        # Deepest first, so that a parent is always warmer than its children and the
        # cold end of each order holds leaves.
        for block in reversed(chain):
            block.seen += 1
            if block.offset is not None:
                block.ns.dram.policy(block.ns.cls).access(block)
            if block.ssd_offset is not None and self.ssd is not None:
                assert block.ns.ssd_cls is not None
                self.ssd.policy(block.ns.ssd_cls).access(block)

    # -- reserve / commit / abort -----------------------------------------------------------
    def reserve(
        self,
        owner: Owner,
        ns: Namespace,
        keys: Sequence[bytes],
        parent: bytes | None,
        now: float,
    ) -> Reservation:
        """DRAM slots for every key, or an error (or DemotionNeeded) and nothing taken."""
        state = self.touch_owner(owner, now)
        if len(state.reservations) >= self.limits.max_reservations_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.reservations)} open reservations "
                f"(limit {self.limits.max_reservations_per_owner}); commit or abort some"
            )
        parent_block = None
        if parent is not None:
            parent_block = ns.blocks.get(parent)
            if parent_block is None or not parent_block.present:
                raise NotFoundError(
                    "the parent of the first key is not cached (evicted since lookup?); "
                    "look up the chain again and reserve from its longest cached prefix"
                )
        offsets = self._allocate(ns, len(keys), protect=parent_block)
        pinned = parent_block is not None and self._hold(parent_block)  # keep it till commit
        r = Reservation(next(self._ids), owner, ns, list(keys), parent_block, offsets, pinned)
        state.reservations[r.id] = r
        self.reserved_slots += len(offsets)
        self.counters.reservations += 1
        return r

    def _allocate(self, ns: Namespace, count: int, protect: Block | None = None) -> list[int]:
        """DRAM slots, evicting (or planning demotions) as needed; all or nothing."""
        pool, cls = ns.dram.pool, ns.cls
        if self.tenant_quota and not self.per_tenant:
            self._make_quota_room(ns, count, protect)  # among the tenant's own blocks
        if pool.available(cls) < count:
            self._make_room(ns.dram, cls, count - pool.available(cls), protect,
                            requester=(ns.tenant, count * cls.slot_bytes))
        offsets = ns.dram.take(ns, count)
        assert offsets is not None, "allocation failed after making room"
        return offsets

    def _make_quota_room(self, ns: Namespace, count: int, protect: Block | None) -> None:
        """Evict (or plan demotions of) the tenant's own coldest blocks, of any size, until
        ``count`` more slots fit its quota; refused, with nothing evicted, when even every
        unpinned block of it would not do."""
        dram, slot, tenant = ns.dram, ns.cls.slot_bytes, ns.tenant
        held = dram.used.get(tenant, 0)
        excess = held + count * slot - self.tenant_quota
        if excess <= 0:
            return

        def refuse() -> NoReturn:
            if self._room_coming(None, tenant):
                raise DemotionNeeded([])
            self.counters.capacity_rejects += 1
            raise CapacityError(
                f"tenant {tenant!r} holds {held} bytes of the dram tier and asks for "
                f"{count * slot} more; its quota is {self.tenant_quota} bytes, and not enough "
                f"of its blocks can be evicted (release pins, or ask for less)", cause="quota")

        if count * slot > self.tenant_quota or held - dram.pinned.get(tenant, 0) < excess:
            refuse()
        allowed = self._victim_test(protect, tenant)
        policies = [dram.policy(ns.cls)] + [
            policy for size, policy in dram.policies.items() if size != slot]
        to_demote: list[Block] = []
        to_remote: list[Block] = []
        freed = 0
        for policy in policies:
            while freed < excess and (victim := policy.pop_victim(allowed)) is not None:
                freed += victim.ns.cls.slot_bytes
                self._evict(victim, to_demote, to_remote)
        if freed < excess:
            self._put_back(to_demote + to_remote)
            refuse()
        if to_demote or to_remote:
            raise DemotionNeeded(to_demote, to_remote)

    def _victim_test(self, protect: Block | None,
                     tenant: str | None = None) -> Callable[[Block], bool]:
        """Which blocks eviction may take now (of ``tenant`` only, if given)."""
        evict = self.allow_evict

        def allowed(b: Block) -> bool:
            if b.refs or b is protect or (tenant is not None and b.ns.tenant != tenant):
                return False
            if b.ssd_offset is not None or (b.children == 0 and not self._admitted(b)):
                return evict          # leaves DRAM without a write
            return self._admitted(b)  # written back first

        return allowed

    def _evict(self, victim: Block, to_demote: list[Block], to_remote: list[Block]) -> None:
        """A victim off its eviction order leaves DRAM now, or is marked to be written back
        first (to SSD, or to the remote store in its write-back mode)."""
        if victim.ssd_offset is not None:
            self._drop_dram_copy(victim)          # clean: the SSD copy stays
        elif self._admitted(victim):
            victim.demoting = True                # dirty: write it back first
            to_demote.append(victim)
        elif self._remote_dirty(victim):
            victim.demoting = True                # to the remote store first
            self.remote_demoting.add(victim)
            to_remote.append(victim)
        else:
            self._drop_dram_copy(victim)          # a cold leaf the SSD tier declines
            self.counters.dropped_on_eviction += 1
        self.counters.evictions += 1

    def _put_back(self, blocks: list[Block]) -> None:
        """Victims marked for a write that will not happen: back on their orders."""
        for b in blocks:
            self.remote_demoting.discard(b)
            self._back_on_order(b)

    @staticmethod
    def _back_on_order(b: Block) -> None:
        """A demoting block stays in DRAM after all: on its eviction order again (pinned
        there if a reader pinned it meanwhile)."""
        b.demoting = False
        policy = b.ns.dram.policy(b.ns.cls)
        policy.insert(b)
        if b.refs:
            policy.pin(b)

    def _over_share(self, dram: TierSlots,
                    requester: tuple[str, int] | None) -> dict[str, int]:
        """Tenants of a shared tier that hold more than their weighted share of it (the
        requester counted with the bytes it asks for): the bytes each holds beyond it."""
        used = dict(dram.used)
        if requester is not None:
            used[requester[0]] = used.get(requester[0], 0) + requester[1]
        if self.per_tenant or len(used) < 2:
            return {}
        weights = {t: self.tenant_weights.get(t, 1.0) for t in used}
        total = sum(weights.values())
        capacity = dram.pool.capacity_bytes
        shares = {t: capacity * weights[t] / total for t in used}
        return {t: held - int(shares[t]) for t, held in used.items() if held > shares[t]}

    def _make_room(self, dram: TierSlots, cls: SlabClass, need: int,
                   protect: Block | None,
                   requester: tuple[str, int] | None = None) -> None:
        """Free ``need`` slots of ``cls``: evict, or plan demotions (DemotionNeeded), taking
        tenants over their share first (``requester``: the tenant asking, and the bytes it
        asks for)."""
        pool = dram.pool
        policy = dram.policy(cls)
        if need > len(policy):
            if self._room_coming(cls):
                raise DemotionNeeded([])  # room is on its way: wait for those writes
            self.counters.capacity_rejects += 1
            raise CapacityError(
                f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested, "
                f"{pool.available(cls)} free and {len(policy)} evictable in the dram tier; "
                f"release pins or raise its capacity", cause="pinned")

        allowed = self._victim_test(protect)
        over = self._over_share(dram, requester)

        def over_share(b: Block) -> bool:
            return over.get(b.ns.tenant, 0) > 0 and allowed(b)

        # Each request demotes its own victims: the room its writes free is taken right
        # when they finish, with no await in between for another request to slip into.
        to_demote: list[Block] = []
        to_remote: list[Block] = []
        taken = 0
        while taken < need:
            victim = policy.pop_victim(over_share) if over else None
            if victim is None:
                victim = policy.pop_victim(allowed)
            if victim is None:
                self._put_back(to_demote + to_remote)  # nothing was written yet
                if self._room_coming(cls):
                    raise DemotionNeeded([])
                self.counters.capacity_rejects += 1
                raise CapacityError(
                    f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested; "
                    f"the dram tier is full of pinned blocks or their prefixes", cause="pinned")
            taken += 1
            if victim.ns.tenant in over:
                over[victim.ns.tenant] -= cls.slot_bytes
            self._evict(victim, to_demote, to_remote)
        if to_demote or to_remote:
            raise DemotionNeeded(to_demote, to_remote)

    def _room_coming(self, cls: SlabClass | None, tenant: str | None = None) -> bool:
        """Whether writes under way will free or unpin DRAM slots of ``cls`` (of any
        class if None; of ``tenant``'s, if given): a demoted block leaves DRAM, a
        written-through one becomes evictable."""
        def mine(b: Block) -> bool:
            return ((cls is None or b.ns.cls is cls)
                    and (tenant is None or b.ns.tenant == tenant))

        return any(mine(b) for t in self.transfers.values() if t.tier == SSD
                   for b in t.blocks) or any(mine(b) for b in self.remote_demoting)

    def _remote_dirty(self, block: Block) -> bool:
        return not block.remote and self._remote_writing_back()

    def finish_remote_write(self, blocks: list[Block], ok: list[bool]) -> None:
        """The write-back of demoting blocks to the remote store ended: the written ones
        leave DRAM (unless pinned meanwhile), the others return to its eviction order."""
        for b, good in zip(blocks, ok):
            if b not in self.remote_demoting:
                continue
            self.remote_demoting.discard(b)
            if good:
                b.remote = True
                self.counters.remote_writebacks += 1
            if b.offset is None:
                b.demoting = False
            elif good and b.refs == 0:
                self._drop_dram_copy(b)
            else:
                self._back_on_order(b)

    def _admitted(self, block: Block) -> bool:
        return (self.ssd is not None and self.ssd_writable and self.allow_demote
                and block.seen >= self.ssd_admit_after)

    def _state(self, owner: Owner) -> OwnerState:
        state = self.owners.get(owner)
        if state is None:
            raise LeaseExpiredError("the session's lease ran out; its holdings were rolled back")
        return state

    def _take_reservation(self, owner: Owner, rid: int, now: float) -> tuple[OwnerState, Reservation]:
        state = self._state(owner)
        r = state.reservations.get(rid)
        if r is None:
            raise NotFoundError(f"no open reservation {rid} in this session (lease expired, "
                                f"or already committed or aborted)")
        if state.deadline <= now:
            self.counters.lease_expiries += 1
            self._rollback(state, r)
            raise LeaseExpiredError(f"reservation {rid} outlived its lease and was rolled back")
        return state, r

    def commit(self, owner: Owner, rid: int, now: float,
               checksums: Sequence[int] = ()) -> CommitResult:
        """Publish a reservation's blocks (with the writer's checksums, if given)."""
        state, r = self._take_reservation(owner, rid, now)
        if checksums and len(checksums) != len(r.keys):
            from kvstore.errors import MalformedError

            raise MalformedError(f"{len(checksums)} checksums for {len(r.keys)} blocks")
        del state.reservations[rid]
        self.reserved_slots -= len(r.offsets)
        ns = r.ns
        policy = ns.dram.policy(ns.cls)
        parent = r.parent
        duplicates: list[int] = []
        fresh: list[Block] = []
        for i, (key, offset) in enumerate(zip(r.keys, r.offsets)):
            block = ns.blocks.get(key)
            if block is None:
                block = Block(key, ns, parent)
                if parent is not None:
                    parent.children += 1
                ns.blocks[key] = block
                if checksums:
                    block.checksum = checksums[i]
            if block.offset is not None or block.promoting:
                duplicates.append(offset)
            else:
                block.offset = offset       # new, or only on SSD: this is its DRAM copy
                fresh.append(block)
            block.seen += 1
            parent = block
        for block in reversed(fresh):  # deepest first: parents end up warmer
            policy.insert(block)
        if self.ssd is not None:
            dirty = self._dirty.setdefault(ns.cls, {})
            for block in fresh:
                if block.ssd_offset is None:
                    dirty[block] = None
        if duplicates:
            ns.dram.give(ns, duplicates)
        self.committed_slots += len(fresh)
        self.counters.peak_committed = max(self.counters.peak_committed, self.committed_slots)
        if r.parent is not None:
            self._unhold(r.parent, r.parent_pinned)
        self.counters.committed_blocks += len(fresh)
        self.counters.duplicate_blocks += len(duplicates)
        return CommitResult(len(fresh), len(duplicates), fresh)

    def abort(self, owner: Owner, rid: int) -> None:
        state = self._state(owner)
        r = state.reservations.get(rid)
        if r is None:
            raise NotFoundError(f"no open reservation {rid} in this session")
        self.counters.aborts += 1
        self._rollback(state, r)

    def _rollback(self, state: OwnerState, r: Reservation) -> None:
        del state.reservations[r.id]
        self.reserved_slots -= len(r.offsets)
        r.ns.dram.give(r.ns, r.offsets)
        if r.parent is not None:
            self._unhold(r.parent, r.parent_pinned)

    # -- acquire / release ------------------------------------------------------------------
    def acquire(self, owner: Owner, ns: Namespace, keys: Sequence[bytes], now: float) -> Pin:
        """Pin every key's DRAM copy; NotFoundError, or PromotionNeeded for blocks only on
        SSD, and nothing pinned."""
        state = self.touch_owner(owner, now)
        if len(state.pins) >= self.limits.max_pins_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.pins)} pins (limit "
                f"{self.limits.max_pins_per_owner}); release some"
            )
        blocks: list[Block] = []
        for i, key in enumerate(keys):
            block = ns.blocks.get(key)
            if block is None or not block.present:
                raise NotFoundError(f"key {i} of {len(keys)} ({key.hex()}) is not cached")
            blocks.append(block)
        below = [b for b in blocks if b.offset is None]
        if below:
            raise PromotionNeeded(below)
        self._access(blocks)
        for block in blocks:
            self._pin_block(block)
        if self.gpu is not None:
            self.gpu.touch(blocks)
        pin = Pin(next(self._ids), owner, blocks)
        state.pins[pin.id] = pin
        self.counters.acquires += 1
        return pin

    def release(self, owner: Owner, pin_id: int) -> None:
        state = self._state(owner)
        pin = state.pins.get(pin_id)
        if pin is None:
            raise NotFoundError(f"no pin {pin_id} in this session")
        self._unpin(state, pin)

    def _unpin(self, state: OwnerState, pin: Pin) -> None:
        del state.pins[pin.id]
        for block in reversed(pin.blocks):  # deepest first: parents end up warmer
            self._unpin_block(block)

    def _pin_block(self, block: Block) -> None:
        assert block.offset is not None, f"pinning {block} without a DRAM copy"
        block.refs += 1
        if block.refs == 1:
            pinned = block.ns.dram.pinned
            pinned[block.ns.tenant] = pinned.get(block.ns.tenant, 0) + block.ns.cls.slot_bytes
            if not block.demoting:  # a demoting block is off the order
                block.ns.dram.policy(block.ns.cls).pin(block)

    def _unpin_block(self, block: Block) -> None:
        assert block.refs > 0, f"{block} released more often than pinned"
        block.refs -= 1
        if block.refs == 0:
            pinned = block.ns.dram.pinned
            left = pinned[block.ns.tenant] - block.ns.cls.slot_bytes
            if left:
                pinned[block.ns.tenant] = left
            else:
                del pinned[block.ns.tenant]
        if block.refs == 0 and not block.demoting:
            block.ns.dram.policy(block.ns.cls).unpin(block)
            if self._hollow:
                self._sweep_hollow()

    def _hold(self, block: Block) -> bool:
        """Keep a block where it is (a reservation's parent); True if its DRAM copy was
        pinned, False if its SSD copy is held."""
        if block.offset is not None:
            self._pin_block(block)
            return True
        block.ssd_holds += 1
        return False

    def _unhold(self, block: Block, pinned: bool) -> None:
        if pinned:
            self._unpin_block(block)
        else:
            block.ssd_holds -= 1
            self._forget_if_gone(block)
            if self._hollow:
                self._sweep_hollow()

    # -- removing copies --------------------------------------------------------------------
    def _drop_dram_copy(self, block: Block) -> None:
        """Free the DRAM slot (the block must be off the eviction order or is taken off)."""
        assert block.offset is not None and block.refs == 0
        ns = block.ns
        ns.dram.policy(ns.cls).remove(block)
        if block.gpu_offset is not None and self.gpu is not None:
            self.gpu.drop(block)  # a GPU copy lives no longer than the DRAM copy
        ns.dram.give(ns, [block.offset])
        block.offset = None
        block.demoting = False
        self.committed_slots -= 1
        if self._dirty:
            self._dirty.get(ns.cls, {}).pop(block, None)
        self._forget_if_gone(block)

    def _drop_ssd_copy(self, block: Block) -> tuple[bytes, bytes]:
        ns = block.ns
        cls = ns.ssd_cls
        assert block.ssd_offset is not None and self.ssd is not None and cls is not None
        self.ssd.policy(cls).remove(block)
        self.ssd.pool.free(cls, [block.ssd_offset])
        block.ssd_offset = None
        block.ssd_record = None
        self.ssd_committed_slots -= 1
        self._forget_if_gone(block)
        return ns.id, block.key

    def _forget_if_gone(self, block: Block | None) -> None:
        """Remove entries that hold no copy, nothing depends on and nothing holds."""
        while (block is not None and not block.present and block.children == 0
               and block.ssd_holds == 0 and not block.promoting
               and block.ns.blocks.get(block.key) is block):
            del block.ns.blocks[block.key]
            parent = block.parent
            if parent is not None:
                parent.children -= 1
            block = parent

    def evict(self, ns: Namespace, keys: Iterable[bytes]) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Drop the given blocks and what depends on them, from every tier, except what is
        pinned or moving; returns (entries removed, keys whose SSD copy went)."""
        removed_ssd: list[tuple[bytes, bytes]] = []
        before = len(ns.blocks)
        for key in keys:
            block = ns.blocks.get(key)
            if block is not None:
                self._drop_subtree(ns, [block], removed_ssd)
        return before - len(ns.blocks), removed_ssd

    def drop_namespace(self, ns: Namespace) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Drop every block of a namespace that is not pinned or moving."""
        removed_ssd: list[tuple[bytes, bytes]] = []
        before = len(ns.blocks)
        self._drop_subtree(ns, [b for b in ns.blocks.values() if b.parent is None], removed_ssd)
        return before - len(ns.blocks), removed_ssd

    def _drop_subtree(self, ns: Namespace, roots: list[Block], removed_ssd: list[tuple[bytes, bytes]]) -> None:
        children: dict[Block, list[Block]] = {}
        for b in ns.blocks.values():
            if b.parent is not None:
                children.setdefault(b.parent, []).append(b)
        order: list[Block] = []
        stack = list(roots)
        while stack:
            b = stack.pop()
            order.append(b)
            stack.extend(children.get(b, ()))
        for b in reversed(order):  # leaves before their parents
            if b.children or b.refs or b.demoting or b.promoting or b.ssd_holds:
                continue
            if b.offset is not None:
                self._drop_dram_copy_unchecked(b)
            if b.ssd_offset is not None:
                removed_ssd.append(self._drop_ssd_copy(b))

    def _sweep_hollow(self) -> None:
        """Drop what hangs below hollow entries once it is no longer in use."""
        for b in list(self._hollow):
            if b.ns.blocks.get(b.key) is b and not b.present:
                self._drop_subtree(b.ns, [b], self.dropped_ssd)
                self._forget_if_gone(b)
            if b.ns.blocks.get(b.key) is not b or b.present:
                self._hollow.discard(b)

    def _drop_dram_copy_unchecked(self, block: Block) -> None:
        # the SSD copy, if any, goes right after: keep the entry alive until then
        block.ssd_holds += 1
        self._drop_dram_copy(block)
        block.ssd_holds -= 1
        self._forget_if_gone(block)

    # -- SSD: demotion, write-through, promotion, restart -----------------------------------
    def ssd_reserve(self, blocks: list[Block]) -> tuple[Transfer, list[tuple[bytes, bytes]]]:
        """SSD slots for blocks about to be written there, evicting cold SSD copies; returns
        the transfer and the keys whose SSD copies went (to withdraw from the index)."""
        assert self.ssd is not None, "no SSD tier"
        for b in blocks:
            assert b.offset is not None and b.ssd_offset is None, (
                f"{b} cannot be written to ssd now")
        removed: list[tuple[bytes, bytes]] = []
        offsets: list[int] = []
        by_class: dict[int, list[Block]] = {}
        for b in blocks:
            assert b.ns.ssd_cls is not None
            by_class.setdefault(b.ns.ssd_cls.slot_bytes, []).append(b)
        for group in by_class.values():
            cls = group[0].ns.ssd_cls
            assert cls is not None
            pool, policy = self.ssd.pool, self.ssd.policy(cls)
            members = set(group)

            def allowed(b: Block) -> bool:
                if b.ssd_holds or b in members:
                    return False
                return b.offset is not None or b.children == 0

            while pool.available(cls) < len(group):
                victim = self._clean_ssd_victim(policy, allowed)
                if victim is None:
                    victim = policy.pop_victim(allowed)
                if victim is None:
                    if offsets:
                        self._free_ssd_offsets(blocks[: len(offsets)], offsets)
                    raise CapacityError(
                        f"the ssd tier has no room for {len(group)} blocks of "
                        f"{cls.slot_bytes} bytes")
                if (victim.offset is None and not victim.remote
                        and self.remote_write_back is not None):
                    self.counters.ssd_evicted_unwritten += 1  # its last copy goes
                removed.append(self._drop_ssd_copy(victim))
                self.counters.ssd_evictions += 1
            got = pool.allocate(cls, len(group))
            assert got is not None
            offsets.extend(got)
        ordered = [b for group in by_class.values() for b in group]
        t = Transfer(next(self._ids), SSD, ordered, offsets, [b.demoting for b in ordered])
        self.transfers[t.id] = t
        self.ssd_reserved_slots += len(offsets)
        for b in ordered:
            if not b.demoting:
                self._pin_block(b)   # write-through: keep the DRAM copy while it is read
        return t, removed

    def _free_ssd_offsets(self, blocks: list[Block], offsets: list[int]) -> None:
        assert self.ssd is not None
        for b, off in zip(blocks, offsets):
            assert b.ns.ssd_cls is not None
            self.ssd.pool.free(b.ns.ssd_cls, [off])

    def finish_ssd_write(self, t: Transfer, records: list[Any] | None) -> None:
        """The write of a transfer ended: ``records`` per block on success, None on failure.

        Demoted blocks then leave DRAM (or, on failure, or if pinned meanwhile, return to
        its eviction order); written-through blocks keep both copies."""
        assert self.ssd is not None
        del self.transfers[t.id]
        self.ssd_reserved_slots -= len(t.offsets)
        for i, (b, off, demote) in enumerate(zip(t.blocks, t.offsets, t.demote)):
            cls = b.ns.ssd_cls
            assert cls is not None
            if records is None or b.ssd_offset is not None:
                self.ssd.pool.free(cls, [off])
            else:
                b.ssd_offset = off
                b.ssd_record = records[i]
                self.ssd.policy(cls).insert(b)
                self.ssd_committed_slots += 1
                self._dirty.get(b.ns.cls, {}).pop(b, None)
                self.counters.ssd_writes += 1
                self.counters.demotions += demote
            if not demote:
                self._unpin_block(b)
                continue
            if b.ssd_offset is not None and b.refs == 0:
                self._drop_dram_copy(b)
            else:  # the write failed, or a reader pinned it meanwhile: it stays in DRAM
                self._back_on_order(b)

    def abort_demotion(self, blocks: list[Block]) -> None:
        """Demotion victims that could not be written: back on the DRAM eviction order."""
        for b in blocks:
            if b.demoting:
                self._back_on_order(b)

    def writeback_plan(self, high: float = 0.75, low: float = 0.5,
                       batch: int = 64) -> list[Block]:
        """Cold blocks to copy to SSD ahead of need: where blocks only in DRAM fill more
        than ``high`` of a class's share of the tier, the oldest down towards ``low``, so
        that eviction finds clean blocks it can drop at once."""
        plan: list[Block] = []
        for cls, dirty in self._dirty.items():
            if not dirty:
                continue
            total = next(iter(dirty)).ns.dram.pool.capacity_bytes // cls.slot_bytes
            if len(dirty) <= high * total:
                continue
            want = min(batch, len(dirty) - int(low * total))
            for b in dirty:
                if len(plan) >= want:
                    break
                if b.refs == 0 and not b.demoting and self._admitted(b):
                    plan.append(b)
        return plan

    def _clean_ssd_victim(self, policy: EvictionPolicy[Block],
                          allowed: Callable[[Block], bool]) -> Block | None:
        """In the remote store's write-back mode, an SSD victim among the coldest few
        that the remote store holds too, taken off the order; None if there is none (or
        no such mode): the plain victim then."""
        if not (isinstance(policy, LRUPolicy) and self._remote_writing_back()):
            return None
        coldest: Iterator[Block] = policy.coldest()
        for b in itertools.islice(coldest, _CLEAN_VICTIM_REACH):
            if b.remote and allowed(b):
                policy.remove(b)  # the iteration ends here: no change while it runs
                return b
        return None

    def _remote_writing_back(self) -> bool:
        return self.remote_write_back is not None and self.remote_write_back()

    def ssd_write_back_plan(self, max_bytes: int = 16 << 20) -> list[Block]:
        """SSD copies near eviction that the remote store lacks (its write-back mode, where
        the SSD tier is the last local one): in each SSD class with fewer free slots than
        its window (``_SEND_WINDOW_BYTES`` of slots, or an eighth of the class if less,
        but at least twice what eviction looks through for a sent copy), those among
        its coldest window of copies, coldest first, up to ``max_bytes`` and never more
        than half of the class's evictable copies (eviction needs the others).  Their SSD
        copies are held until :meth:`ssd_write_back_done`.  Costs at most a window's walk
        along the eviction order."""
        if self.ssd is None or not self._remote_writing_back():
            return []
        plan: list[Block] = []
        size = 0
        for slot_bytes, policy in self.ssd.policies.items():
            if not isinstance(policy, LRUPolicy):
                continue  # the SSD tier's order is LRU; only an order says what is coldest
            evictable = len(policy)
            free = self.ssd.pool.available(self.ssd.pool.classes[slot_bytes])
            window = max(2 * _CLEAN_VICTIM_REACH,
                         min(_SEND_WINDOW_BYTES // slot_bytes, (evictable + free) // 8))
            if free >= window:
                continue
            coldest: Iterator[Block] = policy.coldest()
            taken = 0
            for b in itertools.islice(coldest, window - free):
                if size >= max_bytes or taken >= evictable // 2:
                    break
                if not b.remote and b.ssd_holds == 0:
                    plan.append(b)
                    size += b.ns.block_bytes
                    taken += 1
        for b in plan:
            b.ssd_holds += 1
        return plan

    def ssd_write_back_done(self, blocks: list[Block], sent: list[bool],
                            unreadable: list[bool]) -> list[tuple[bytes, bytes]]:
        """The blocks of :meth:`ssd_write_back_plan` were sent (``sent``), or not.  A copy
        whose read failed (``unreadable``) is corrupt on disk and goes, as a failed
        promotion's does; returns the SSD copies dropped, to withdraw from the index."""
        removed: list[tuple[bytes, bytes]] = []
        for b, done, bad in zip(blocks, sent, unreadable):
            b.ssd_holds -= 1
            if done:
                b.remote = True
                self.counters.remote_writebacks += 1
            elif bad:
                self._corrupt_on_ssd(b, removed)
            self._forget_if_gone(b)
        if self._hollow:
            self._sweep_hollow()
        return removed

    def write_through_candidates(self, blocks: Iterable[Block]) -> list[Block]:
        """Newly committed blocks the SSD tier should copy now (write-through)."""
        return [b for b in blocks if b.offset is not None and b.ssd_offset is None
                and not b.demoting and self._admitted(b) and b.ns.blocks.get(b.key) is b]

    def gpu_begin(self, blocks: Iterable[Block]) -> list[tuple[Block, int]]:
        """GPU slots to copy blocks' DRAM copies into; the DRAM copies stay pinned (and
        so in place) until :meth:`gpu_end`."""
        if self.gpu is None:
            return []
        plan = self.gpu.plan(b for b in blocks if b.ns.blocks.get(b.key) is b)
        for b, _ in plan:
            self._pin_block(b)
        return plan

    def gpu_end(self, plan: list[tuple[Block, int]], ok: bool) -> None:
        """The copies of a :meth:`gpu_begin` plan ended (all well, or not)."""
        assert self.gpu is not None
        for b, _ in plan:
            self.gpu.finish(b, ok)
            self._unpin_block(b)

    def begin_promotion(self, blocks: list[Block]) -> Transfer:
        """DRAM slots to read SSD-only blocks into; may raise DemotionNeeded/CapacityError."""
        todo = [b for b in dict.fromkeys(blocks)
                if b.offset is None and b.ssd_offset is not None and not b.promoting]
        offsets: list[int] = []
        by_ns: dict[Namespace, list[Block]] = {}
        for b in todo:
            by_ns.setdefault(b.ns, []).append(b)
        taken: list[tuple[Namespace, list[int]]] = []
        try:
            for ns, group in by_ns.items():
                got = self._allocate(ns, len(group))
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
        t = Transfer(next(self._ids), DRAM, ordered, offsets)
        self.transfers[t.id] = t
        self.reserved_slots += len(offsets)
        return t

    def finish_promotion(self, t: Transfer, ok: list[bool]) -> list[tuple[bytes, bytes]]:
        """Reads ended: good ones become DRAM copies.  A failed one (corrupt on disk) loses
        its SSD copy, and what depends on it goes too unless pinned; returns the SSD
        copies dropped, to withdraw from the index."""
        removed: list[tuple[bytes, bytes]] = []
        del self.transfers[t.id]
        self.reserved_slots -= len(t.offsets)
        failed: list[Block] = []
        for b, off, good in zip(t.blocks, t.offsets, ok):
            b.promoting = False
            b.ssd_holds -= 1
            if good and b.ssd_offset is not None:
                b.offset = off
                self.committed_slots += 1
                b.ns.dram.policy(b.ns.cls).insert(b)
                self.counters.promotions += 1
            else:
                b.ns.dram.give(b.ns, [off])
                if good:
                    self._forget_if_gone(b)
                else:
                    failed.append(b)
        for b in failed:  # after the good ones, which may hang below a failed one
            self._corrupt_on_ssd(b, removed)
        self.counters.peak_committed = max(self.counters.peak_committed, self.committed_slots)
        return removed

    def _corrupt_on_ssd(self, b: Block, removed: list[tuple[bytes, bytes]]) -> None:
        """A read of the block's SSD copy failed its checksum: the copy goes (unless
        another read holds it), and if that was the block's last copy, what hangs below
        it goes too unless in use; the SSD copies dropped are added to ``removed``."""
        self.counters.checksum_failures += 1
        if b.ssd_offset is not None and b.ssd_holds == 0:
            removed.append(self._drop_ssd_copy(b))
        if not b.present and b.ns.blocks.get(b.key) is b:
            # a hole in the chain: what hangs below it can no longer be found
            self._drop_subtree(b.ns, [b], removed)
        self._forget_if_gone(b)
        if b.ns.blocks.get(b.key) is b and not b.present:
            self._hollow.add(b)  # something below is in use: drop it when released

    def restore_ssd_block(self, ns: Namespace, key: bytes, parent: bytes | None,
                          offset: int, record: Any) -> bool:
        """Take back a block found on SSD at start-up (parents first); False if it does not
        fit this configuration."""
        assert self.ssd is not None and ns.ssd_cls is not None
        parent_block = ns.blocks.get(parent) if parent is not None else None
        if (parent is not None and parent_block is None) or key in ns.blocks:
            return False
        if not self.ssd.pool.claim(ns.ssd_cls, offset):
            return False
        block = Block(key, ns, parent_block)
        block.ssd_offset = offset
        block.ssd_record = record
        block.checksum = getattr(record, "checksum", 0)  # the same xxh3_64 as clients use
        block.seen = self.ssd_admit_after
        if parent_block is not None:
            parent_block.children += 1
        ns.blocks[key] = block
        self.ssd.policy(ns.ssd_cls).insert(block)
        self.ssd_committed_slots += 1
        return True

    # -- inspection -----------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, dict[str, int]]:
        c = self.counters
        dram_reserved = sum(len(r.offsets) * r.ns.cls.slot_bytes for s in self.owners.values()
                            for r in s.reservations.values())
        dram_reserved += sum(len(t.offsets) * b.ns.cls.slot_bytes
                             for t in self.transfers.values() if t.tier == DRAM
                             for b in t.blocks[:1])
        dram_committed = sum(ns.cls.slot_bytes for ns in self.namespaces.values()
                             for b in ns.blocks.values() if b.offset is not None)
        dram_blocks = sum(1 for ns in self.namespaces.values() for b in ns.blocks.values()
                          if b.offset is not None)
        pools = [t.pool for t in self.drams.values()]
        capacity = (sum(p.capacity_bytes for p in pools) if self.per_tenant
                    else self._dram_args[0])
        out = {DRAM: {
            "capacity": capacity,
            "free": capacity - dram_reserved - dram_committed,
            "reserved": dram_reserved,
            "committed": dram_committed,
            "reserved_slots": self.reserved_slots,
            "committed_slots": self.committed_slots,
            "blocks": dram_blocks,
            "pinned_blocks": sum(1 for ns in self.namespaces.values()
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
        if self.ssd is not None:
            spool = self.ssd.pool
            committed = sum(b.ns.ssd_cls.slot_bytes for ns in self.namespaces.values()
                            for b in ns.blocks.values()
                            if b.ssd_offset is not None and b.ns.ssd_cls is not None)
            reserved = sum(len(t.offsets) * (t.blocks[0].ns.ssd_cls.slot_bytes
                                              if t.blocks and t.blocks[0].ns.ssd_cls else 0)
                           for t in self.transfers.values() if t.tier == SSD)
            out[SSD] = {
                "capacity": spool.capacity_bytes,
                "free": spool.capacity_bytes - reserved - committed,
                "reserved": reserved,
                "committed": committed,
                "reserved_slots": self.ssd_reserved_slots,
                "committed_slots": self.ssd_committed_slots,
                "blocks": self.ssd_committed_slots,
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
        if self.gpu is not None:
            out["gpu"] = self.gpu.stats()
        return out

    def stats(self) -> dict[str, int]:
        """The DRAM tier's figures (see ``tier_stats`` for every tier)."""
        return self.tier_stats()[DRAM]

    def check_invariants(self) -> None:
        """Conservation per tier and class, one state per slot, closure, pins off orders."""
        for dram in self.drams.values():
            dram.pool.check()
        if self.ssd is not None:
            self.ssd.pool.check()
        reserved: dict[SlabClass, list[int]] = {}
        pin_counts: dict[Block, int] = {}
        for state in self.owners.values():
            for r in state.reservations.values():
                reserved.setdefault(r.ns.cls, []).extend(r.offsets)
                if r.parent is not None and r.parent_pinned:
                    pin_counts[r.parent] = pin_counts.get(r.parent, 0) + 1
            for pin in state.pins.values():
                for b in pin.blocks:
                    pin_counts[b] = pin_counts.get(b, 0) + 1
        for t in self.transfers.values():
            for b, off in zip(t.blocks, t.offsets):
                cls = b.ns.cls if t.tier == DRAM else b.ns.ssd_cls
                assert cls is not None
                reserved.setdefault(cls, []).append(off)
        for t in self.transfers.values():
            for b, demote in zip(t.blocks, t.demote):
                if t.tier == SSD and not demote:
                    pin_counts[b] = pin_counts.get(b, 0) + 1
        if self.gpu is not None:
            for b in self.gpu.copying:  # read into the GPU tier: pinned meanwhile
                pin_counts[b] = pin_counts.get(b, 0) + 1
            self.gpu.check(b for ns in self.namespaces.values() for b in ns.blocks.values())
        used: dict[tuple[int, str], int] = {}  # (tier, tenant): bytes of DRAM slots held
        for state in self.owners.values():
            for r in state.reservations.values():
                at = (id(r.ns.dram), r.ns.tenant)
                used[at] = used.get(at, 0) + len(r.offsets) * r.ns.cls.slot_bytes
        for t in self.transfers.values():
            if t.tier == DRAM:
                for b in t.blocks:
                    at = (id(b.ns.dram), b.ns.tenant)
                    used[at] = used.get(at, 0) + b.ns.cls.slot_bytes
        committed: dict[SlabClass, list[int]] = {}
        pinned: dict[tuple[int, str], int] = {}
        for ns in self.namespaces.values():
            at = (id(ns.dram), ns.tenant)
            held = sum(1 for b in ns.blocks.values() if b.offset is not None)
            used[at] = used.get(at, 0) + held * ns.cls.slot_bytes
            held_pins = sum(1 for b in ns.blocks.values() if b.refs)
            pinned[at] = pinned.get(at, 0) + held_pins * ns.cls.slot_bytes
        for dram in self.drams.values():
            for tenant, nbytes in dram.pinned.items():
                assert pinned.pop((id(dram), tenant), 0) == nbytes, (
                    f"tenant {tenant!r}: {nbytes} bytes counted as pinned, not so")
        uncounted = {at: nbytes for at, nbytes in pinned.items() if nbytes}
        assert not uncounted, f"pins not counted per tenant: {uncounted}"
        for dram in self.drams.values():
            for tenant, nbytes in dram.used.items():
                holds = used.pop((id(dram), tenant), 0)
                assert holds == nbytes, (
                    f"tenant {tenant!r} is charged {nbytes} bytes of dram, holds {holds}")
        held_uncharged = {at: nbytes for at, nbytes in used.items() if nbytes}
        assert not held_uncharged, f"dram slots held but not charged: {held_uncharged}"
        for ns in self.namespaces.values():
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
        tiers = [(DRAM, t) for t in self.drams.values()]
        tiers += [(SSD, self.ssd)] if self.ssd is not None else []
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
                    expected = sum(1 for ns in self.namespaces.values() if ns.cls is cls
                                   for b in ns.blocks.values()
                                   if b.offset is not None and b.refs == 0 and not b.demoting)
                else:
                    expected = sum(1 for ns in self.namespaces.values() if ns.ssd_cls is cls
                                   for b in ns.blocks.values() if b.ssd_offset is not None)
                assert len(policy) == expected, (
                    f"{name} class {slot_bytes}: {len(policy)} on the eviction order, "
                    f"{expected} expected")
        for dirty_cls, dirty in self._dirty.items():
            for b in dirty:
                assert b.ns.blocks.get(b.key) is b and b.offset is not None, f"dirty {b} gone"
                assert b.ssd_offset is None and b.ns.cls is dirty_cls, (
                    f"{b} listed dirty but clean")
        ssd_classes = set(self.ssd.pool.classes.values()) if self.ssd is not None else set()
        dram_reserved = sum(len(v) for c, v in reserved.items() if c not in ssd_classes)
        dram_committed = sum(len(v) for c, v in committed.items() if c not in ssd_classes)
        assert dram_reserved == self.reserved_slots, "reserved slot counter is off"
        assert dram_committed == self.committed_slots, "committed slot counter is off"
        ssd_committed = sum(len(v) for c, v in committed.items() if c in ssd_classes)
        assert ssd_committed == self.ssd_committed_slots, "ssd committed counter is off"

    def __repr__(self) -> str:
        return (f"BlockStore(namespaces={len(self.namespaces)}, "
                f"dram committed={self.committed_slots} reserved={self.reserved_slots}, "
                f"ssd committed={self.ssd_committed_slots} reserved={self.ssd_reserved_slots}, "
                f"owners={len(self.owners)}, transfers={len(self.transfers)})")
