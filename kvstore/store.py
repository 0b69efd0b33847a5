"""The block store: namespaces, the key index, reservations, pins and leases.

Pure bookkeeping over slot offsets: no sockets, files or event loop.  The daemon owns
the bytes (the DRAM arena) and asks the store where they go.  Every public method
checks before it mutates, so a failed call leaves nothing behind.

Slot states: a slot is free (in its slab), reserved (held by a ``Reservation`` until it
commits, aborts or its lease ends) or committed (holds a ``Block``; ``refs`` counts the
pins on it).  Prefix closure: a block is only evicted when no cached block depends on
it, so a cached key implies its whole prefix is cached.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.errors import (
    CapacityError,
    LeaseExpiredError,
    LimitExceededError,
    NotFoundError,
)
from kvstore.identity import Identity
from kvstore.pool import SlabClass, SlabPool
from kvstore.scheduler.eviction import EvictionPolicy, make_policy

Owner = Hashable


class Block:
    """A committed block: its key, its place in the chain, its slot and its pins."""

    __slots__ = ("key", "ns", "parent", "children", "offset", "refs")

    def __init__(self, key: bytes, ns: Namespace, parent: Block | None, offset: int) -> None:
        self.key = key
        self.ns = ns
        self.parent = parent
        self.children = 0
        self.offset = offset
        self.refs = 0

    def __repr__(self) -> str:
        return f"Block({self.key.hex()[:12]}, refs={self.refs}, children={self.children})"


class Namespace:
    """One identity's blocks in the daemon."""

    def __init__(self, identity: Identity, cls: SlabClass) -> None:
        self.identity = identity
        self.id = identity.namespace_id
        self.tenant = identity.tenant
        self.block_bytes = identity.block_bytes
        self.cls = cls
        self.blocks: dict[bytes, Block] = {}

    def __repr__(self) -> str:
        return f"Namespace({self.identity.model}, tenant={self.tenant}, blocks={len(self.blocks)})"


@dataclass(eq=False)
class Reservation:
    id: int
    owner: Owner
    ns: Namespace
    keys: list[bytes]
    parent: Block | None
    offsets: list[int]


@dataclass(eq=False)
class Pin:
    id: int
    owner: Owner
    blocks: list[Block]


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


@dataclass(frozen=True)
class Limits:
    lease_seconds: float = 30.0
    max_reservations_per_owner: int = 1024
    max_pins_per_owner: int = 4096


class BlockStore:
    """Namespaces and blocks of one DRAM tier, with reservations, pins and leases."""

    tier = "dram"

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        *,
        limits: Limits = Limits(),
        eviction_policy: str = "lru",
        alignment: int = 64,
    ) -> None:
        self.pool = SlabPool(capacity_bytes, slab_bytes, alignment)
        self.limits = limits
        self.eviction_policy = eviction_policy
        self.namespaces: dict[bytes, Namespace] = {}
        self.owners: dict[Owner, OwnerState] = {}
        self.counters = Counters()
        self._policies: dict[int, EvictionPolicy[Block]] = {}
        self._ids = itertools.count(1)
        self.reserved_slots = 0
        self.committed_slots = 0

    # -- namespaces and owners ------------------------------------------------
    def open_namespace(self, identity: Identity) -> Namespace:
        ns = self.namespaces.get(identity.namespace_id)
        if ns is None:
            cls = self.pool.class_for(identity.block_bytes)
            if cls.slot_bytes not in self._policies:
                self._policies[cls.slot_bytes] = make_policy(self.eviction_policy)  # type: ignore[assignment]
            ns = self.namespaces[identity.namespace_id] = Namespace(identity, cls)
        return ns

    def touch_owner(self, owner: Owner, now: float) -> OwnerState:
        """Renew an owner's lease, which its reservations and pins share."""
        state = self.owners.get(owner)
        deadline = now + self.limits.lease_seconds
        if state is None:
            state = self.owners[owner] = OwnerState(deadline)
        else:
            state.deadline = deadline
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
        """Roll back reservations and owners whose lease ran out; returns owners dropped."""
        gone = [o for o, s in self.owners.items() if s.deadline <= now]
        for owner in gone:
            state = self.owners[owner]
            self.counters.lease_expiries += len(state.reservations) + len(state.pins)
            self.drop_owner(owner)
        return gone

    # -- lookup ---------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """How many leading keys are cached."""
        blocks = ns.blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            hits += 1
        self.counters.lookups += 1
        self.counters.lookup_keys += len(keys)
        self.counters.hit_blocks += hits
        self._access(ns, [blocks[k] for k in keys[:hits]])
        return hits

    def _access(self, ns: Namespace, chain: list[Block]) -> None:
        # Deepest first, so that a parent is always warmer than its children and the
        # cold end of the order holds leaves.
        policy = self._policies[ns.cls.slot_bytes]
        for block in reversed(chain):
            policy.access(block)

    # -- reserve / commit / abort ---------------------------------------------
    def reserve(
        self,
        owner: Owner,
        ns: Namespace,
        keys: Sequence[bytes],
        parent: bytes | None,
        now: float,
    ) -> Reservation:
        """Slots for every key, or an error and nothing taken."""
        state = self.touch_owner(owner, now)
        if len(state.reservations) >= self.limits.max_reservations_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.reservations)} open reservations "
                f"(limit {self.limits.max_reservations_per_owner}); commit or abort some"
            )
        parent_block = None
        if parent is not None:
            parent_block = ns.blocks.get(parent)
            if parent_block is None:
                raise NotFoundError(
                    "the parent of the first key is not cached (evicted since lookup?); "
                    "look up the chain again and reserve from its longest cached prefix"
                )
        count = len(keys)
        if parent_block is not None:
            self._pin_block(parent_block)  # so it cannot be evicted before we commit
        try:
            offsets = self._allocate(ns.cls, count)
        except BaseException:
            if parent_block is not None:
                self._unpin_block(parent_block)
            raise
        r = Reservation(next(self._ids), owner, ns, list(keys), parent_block, offsets)
        state.reservations[r.id] = r
        self.reserved_slots += count
        self.counters.reservations += 1
        return r

    def _allocate(self, cls: SlabClass, count: int) -> list[int]:
        pool = self.pool
        shortfall = count - pool.available(cls)
        if shortfall > 0:
            policy = self._policies[cls.slot_bytes]
            if shortfall > len(policy):
                self.counters.capacity_rejects += 1
                raise CapacityError(
                    f"{count} slots of {cls.slot_bytes} bytes requested, "
                    f"{pool.available(cls)} free and {len(policy)} evictable in the "
                    f"{self.tier} tier; release pins or raise its capacity"
                )
            while pool.available(cls) < count:
                victim = policy.pop_victim(_is_evictable)
                if victim is None:
                    self.counters.capacity_rejects += 1
                    raise CapacityError(
                        f"{count} slots of {cls.slot_bytes} bytes requested; the "
                        f"{self.tier} tier is full of pinned blocks or their prefixes"
                    )
                self._remove_block(victim)
                self.counters.evictions += 1
        offsets = pool.allocate(cls, count)
        assert offsets is not None, "allocation failed after the capacity check"
        return offsets

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

    def commit(self, owner: Owner, rid: int, now: float) -> tuple[int, int]:
        """Publish a reservation's blocks; returns (new blocks, duplicates freed)."""
        state, r = self._take_reservation(owner, rid, now)
        del state.reservations[rid]
        self.reserved_slots -= len(r.offsets)
        ns = r.ns
        policy = self._policies[ns.cls.slot_bytes]
        parent = r.parent
        duplicates: list[int] = []
        fresh: list[Block] = []
        for key, offset in zip(r.keys, r.offsets):
            existing = ns.blocks.get(key)
            if existing is not None:
                duplicates.append(offset)
                parent = existing
                continue
            block = Block(key, ns, parent, offset)
            if parent is not None:
                parent.children += 1
            ns.blocks[key] = block
            fresh.append(block)
            parent = block
        for block in reversed(fresh):  # deepest first: parents end up warmer
            policy.insert(block)
        created = len(fresh)
        if duplicates:
            self.pool.free(ns.cls, duplicates)
        self.committed_slots += created
        if r.parent is not None:
            self._unpin_block(r.parent)
        self.counters.committed_blocks += created
        self.counters.duplicate_blocks += len(duplicates)
        return created, len(duplicates)

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
        self.pool.free(r.ns.cls, r.offsets)
        if r.parent is not None:
            self._unpin_block(r.parent)

    # -- acquire / release ----------------------------------------------------
    def acquire(self, owner: Owner, ns: Namespace, keys: Sequence[bytes], now: float) -> Pin:
        """Pin every key's block, or NotFoundError and nothing pinned."""
        state = self.touch_owner(owner, now)
        if len(state.pins) >= self.limits.max_pins_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.pins)} pins (limit "
                f"{self.limits.max_pins_per_owner}); release some"
            )
        blocks: list[Block] = []
        for i, key in enumerate(keys):
            block = ns.blocks.get(key)
            if block is None:
                raise NotFoundError(f"key {i} of {len(keys)} ({key.hex()}) is not cached")
            blocks.append(block)
        self._access(ns, blocks)
        for block in blocks:
            self._pin_block(block)
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
        block.refs += 1
        if block.refs == 1:
            self._policies[block.ns.cls.slot_bytes].pin(block)

    def _unpin_block(self, block: Block) -> None:
        assert block.refs > 0, f"{block} released more often than pinned"
        block.refs -= 1
        if block.refs == 0:
            self._policies[block.ns.cls.slot_bytes].unpin(block)

    # -- eviction and dropping ------------------------------------------------
    def _remove_block(self, block: Block) -> None:
        ns = block.ns
        del ns.blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        self._policies[ns.cls.slot_bytes].remove(block)
        self.pool.free(ns.cls, [block.offset])
        self.committed_slots -= 1

    def evict(self, ns: Namespace, keys: Iterable[bytes]) -> int:
        """Drop the given unpinned blocks with their unpinned descendants; returns count."""
        removed = 0
        for key in keys:
            block = ns.blocks.get(key)
            if block is not None:
                removed += self._drop_subtree(ns, [block])
        return removed

    def drop_namespace(self, ns: Namespace) -> int:
        """Drop every unpinned block of a namespace (pinned ones and their prefixes stay)."""
        roots = [b for b in ns.blocks.values() if b.parent is None]
        return self._drop_subtree(ns, roots)

    def _drop_subtree(self, ns: Namespace, roots: list[Block]) -> int:
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
        removed = 0
        for b in reversed(order):  # leaves before their parents
            if b.refs == 0 and b.children == 0 and ns.blocks.get(b.key) is b:
                self._remove_block(b)
                removed += 1
        return removed

    # -- inspection -----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        pool = self.pool
        reserved = committed = 0
        for cls in pool.classes.values():
            reserved_c = sum(len(r.offsets) for s in self.owners.values()
                             for r in s.reservations.values() if r.ns.cls is cls)
            reserved += reserved_c * cls.slot_bytes
        for ns in self.namespaces.values():
            committed += len(ns.blocks) * ns.cls.slot_bytes
        c = self.counters
        return {
            "capacity": pool.capacity_bytes,
            "free": pool.capacity_bytes - reserved - committed,
            "reserved": reserved,
            "committed": committed,
            "reserved_slots": self.reserved_slots,
            "committed_slots": self.committed_slots,
            "blocks": sum(len(ns.blocks) for ns in self.namespaces.values()),
            "pinned_blocks": sum(1 for ns in self.namespaces.values()
                                 for b in ns.blocks.values() if b.refs),
            "tail_waste": pool.tail_waste_bytes(),
            "empty_slabs": pool.empty_slabs,
            "hits": c.hit_blocks,
            "lookups": c.lookups,
            "lookup_keys": c.lookup_keys,
            "evictions": c.evictions,
            "commits": c.committed_blocks,
            "duplicates": c.duplicate_blocks,
            "aborts": c.aborts,
            "lease_expiries": c.lease_expiries,
            "capacity_rejects": c.capacity_rejects,
        }

    def check_invariants(self) -> None:
        """Conservation per class, one state per slot, closure, pins off the order."""
        self.pool.check()
        reserved: dict[int, list[int]] = {}
        pin_counts: dict[Block, int] = {}
        for state in self.owners.values():
            for r in state.reservations.values():
                reserved.setdefault(r.ns.cls.slot_bytes, []).extend(r.offsets)
                if r.parent is not None:
                    pin_counts[r.parent] = pin_counts.get(r.parent, 0) + 1
            for pin in state.pins.values():
                for b in pin.blocks:
                    pin_counts[b] = pin_counts.get(b, 0) + 1
        committed: dict[int, list[int]] = {}
        for ns in self.namespaces.values():
            child_counts: dict[Block, int] = {}
            for key, b in ns.blocks.items():
                assert b.key == key and b.ns is ns, f"{b} indexed under the wrong key"
                committed.setdefault(ns.cls.slot_bytes, []).append(b.offset)
                if b.parent is not None:
                    assert ns.blocks.get(b.parent.key) is b.parent, (
                        f"{b} is cached but its parent is not (prefix closure broken)")
                    child_counts[b.parent] = child_counts.get(b.parent, 0) + 1
                assert b.refs == pin_counts.get(b, 0), (
                    f"{b} has refs={b.refs} but {pin_counts.get(b, 0)} pins hold it")
            for b in ns.blocks.values():
                assert b.children == child_counts.get(b, 0), f"{b} child count is off"
        total_reserved = total_committed = 0
        for slot_bytes, cls in self.pool.classes.items():
            free = list(self.pool.free_offsets(cls))
            res = reserved.get(slot_bytes, [])
            com = committed.get(slot_bytes, [])
            total_reserved += len(res)
            total_committed += len(com)
            assert len(free) + len(res) + len(com) == cls.capacity_slots, (
                f"class {slot_bytes}: free {len(free)} + reserved {len(res)} + committed "
                f"{len(com)} != capacity {cls.capacity_slots}")
            every = free + res + com
            assert len(set(every)) == len(every), f"class {slot_bytes}: a slot is in two states"
            policy = self._policies.get(slot_bytes)
            if policy is not None:
                for b in policy.evictable():
                    assert b.refs == 0, f"pinned {b} is on the eviction order"
                    assert b.ns.blocks.get(b.key) is b, f"{b} on the order but not cached"
                unpinned = sum(1 for ns in self.namespaces.values() if ns.cls is cls
                               for b in ns.blocks.values() if b.refs == 0)
                assert len(policy) == unpinned, (
                    f"class {slot_bytes}: {len(policy)} on the eviction order, "
                    f"{unpinned} unpinned committed blocks")
        assert total_reserved == self.reserved_slots, "reserved slot counter is off"
        assert total_committed == self.committed_slots, "committed slot counter is off"

    def __repr__(self) -> str:
        return (f"BlockStore(tier={self.tier}, namespaces={len(self.namespaces)}, "
                f"committed_slots={self.committed_slots}, reserved_slots={self.reserved_slots}, "
                f"owners={len(self.owners)}, pool={self.pool!r})")


def _is_evictable(block: Block) -> bool:
    return block.refs == 0 and block.children == 0

