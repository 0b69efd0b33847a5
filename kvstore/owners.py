"""Who holds what, and for how long: owners' leases.

A session (an *owner*) renews one lease with every request; its reservations and pins
share it.  When the lease ends, or the session goes, everything it holds is rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.blocks import (
    Block,
    Namespace,
    Owner,
    OwnerState,
    Reservation,
    Skip,
    still_awaits,
    trusts,
    unawait,
    writers,
)
from kvstore.core import StoreCore
from kvstore.errors import LeaseExpiredError, NotFoundError


class Leases:
    """The store's owners: leases renewed, expired and dropped with what they hold."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    def touch(self, owner: Owner, now: float) -> OwnerState:
        """Renew an owner's lease, which its reservations and pins share."""
        state = self.store.owners.get(owner)
        deadline = now + self.store.limits.lease_seconds
        if state is None:
            state = self.store.owners[owner] = OwnerState(deadline)
        else:  # never earlier: the daemon's own owners hold leases that never end
            state.deadline = max(state.deadline, deadline)
        return state

    def drop(self, owner: Owner) -> tuple[int, int]:
        """Roll back everything an owner holds; returns (reservations, pins) dropped."""
        state = self.store.owners.pop(owner, None)
        if state is None:
            return 0, 0
        for r in list(state.reservations.values()):
            self.store.rollback(state, r)
        for pin in list(state.pins.values()):
            self.store.unpin(state, pin)
        return len(state.reservations), len(state.pins)

    def expire(self, now: float) -> list[Owner]:
        """Roll back the holdings of owners whose lease ran out; returns them."""
        gone = [o for o, s in self.store.owners.items() if s.deadline <= now]
        for owner in gone:
            state = self.store.owners[owner]
            self.store.counters.lease_expiries += len(state.reservations) + len(state.pins)
            self.drop(owner)
        return gone

    def state(self, owner: Owner) -> OwnerState:
        state = self.store.owners.get(owner)
        if state is None:
            raise LeaseExpiredError("the session's lease ran out; its holdings were rolled back")
        return state

    def take_reservation(self, owner: Owner, rid: int, now: float) -> tuple[OwnerState, Reservation]:
        state = self.state(owner)
        r = state.reservations.get(rid)
        if r is None:
            raise NotFoundError(f"no open reservation {rid} in this session (lease expired, "
                                f"or already committed or aborted)")
        if state.deadline <= now:
            self.store.counters.lease_expiries += 1
            self.store.rollback(state, r)
            raise LeaseExpiredError(f"reservation {rid} outlived its lease and was rolled back")
        return state, r

    def abort(self, owner: Owner, rid: int) -> None:
        """Roll back an open reservation of ``owner``."""
        state = self.state(owner)
        r = state.reservations.get(rid)
        if r is None:
            raise NotFoundError(f"no open reservation {rid} in this session")
        self.store.counters.aborts += 1
        self.store.rollback(state, r)

    def overdue(self, owners: Iterable[Owner], now: float) -> None:
        """A commit waited out the bound for open reservations of ``owners``: for a lease
        from ``now`` no reserve awaits their reservations, open or new
        (``Reservation.overdue``: their keys take a slot), and the commits awaiting one
        await it no more (those left awaiting none go on: what is cached is stored).  A
        session holding a reservation open, renewing its lease (an engine stuck, or a
        careless client), made every commit of every peer saving the same prefix wait out
        the bound and then drop its blocks, for as long as it lived."""
        until = now + self.store.limits.lease_seconds
        for owner in owners:
            state = self.store.owners.get(owner)
            if state is None:
                continue
            state.overdue_until = max(state.overdue_until, until)
            for r in state.reservations.values():
                r.overdue = True
                unawait(r)

    def release(self, owner: Owner, pin_id: int) -> None:
        """Release a pin of ``owner``."""
        state = self.state(owner)
        pin = state.pins.get(pin_id)
        if pin is None:
            raise NotFoundError(f"no pin {pin_id} in this session")
        self.store.unpin(state, pin)

    def pin_held(self, ns: Namespace, keys: Sequence[bytes]) -> dict[int, Block]:
        """Pin the DRAM copies of those of ``keys`` committed there, by their positions:
        a reservation's keys that need no slot (``Reservation.held``).  Pinned, no room
        made for the others evicts them, nor anything else till the commit (a duplicate
        each) or the rollback, so the commit is exact and their children commit under
        them.  A block only on SSD or in the remote store is not held: its commit gives
        it a DRAM copy again (a block written again is wanted soon, and its read from
        below is saved), and a commit over it of other bytes is its rewrite."""
        held: dict[int, Block] = {}
        get = ns.blocks.get
        for i, key in enumerate(keys):
            block = get(key)
            if block is not None and block.offset is not None:
                self.store.pin_block(block)
                held[i] = block
        return held

    def awaited(self, ns: Namespace, keys: Sequence[bytes], held: dict[int, Block],
                owner: Owner, writer: str | None = None) -> set[int]:
        """The positions of those of ``keys`` (not ``held``) open reservations of other
        owners in ``ns`` hold a slot for (``Namespace.pending``), and none of ``owner``'s:
        a reservation's keys that need no slot of their own, that one's bytes coming
        (``Reservation.awaited``).  Two writers of the same uncommitted keys at once
        took a slot each, and the second commit threw its copy away: under pressure each
        slot had evicted a block for nothing.  A key pending in a reservation of the same
        session takes a slot: its commit waits for no reservation of its own session,
        whose client may commit that one only after this one's reply; nor for one that
        awaits (through others) one of its session's (``awaiting``): a session that
        committed its newer reservation first waited out the bound, and so did the
        writer between.  A key twice in ``keys`` is not awaited from itself (its commit
        finds it in DRAM: a duplicate), as only the other reservations are listed yet.
        For a writer of tenant ``writer`` (None: the namespace's own) only reservations
        it ``trusts`` count: a key pending only in another tenant's takes a slot."""
        pending = ns.pending
        if not pending:
            return set()
        state = self.store.owners.get(owner)
        mine = awaiting([r for r in state.reservations.values() if r.ns is ns]
                        if state is not None else [])
        grantee = None if writer == ns.tenant else writer
        return {i for i, key in enumerate(keys) if key in pending and i not in held
                and _awaitable(writers(pending[key]), mine, grantee)}

    def pin_plan(self, ns: Namespace, plan: list[list[bytes]], owner: Owner, writer: str,
                 skip: int) -> tuple[list[dict[int, Block]], list[int]]:
        """For a token plan's requests (their keys), reserved by ``owner`` of tenant
        ``writer`` skipping ``skip`` (``Skip``): the blocks ``pin_held`` pins for each
        (``unpin_held`` each once reserved), and how many of each one's keys take no
        slot, held or ``awaited``, as its reserve then finds them (the plan's own
        reservations add none: a key one takes a slot for, another takes one for too).
        Admission counted every awaited key as a slot: a plan whose new blocks fit was
        refused with DRAM nearly full."""
        held = [self.pin_held(ns, keys) if skip & Skip.HELD else {} for keys in plan]
        if not skip & Skip.PENDING or not ns.pending:
            return held, [len(h) for h in held]
        return held, [len(h) + len(self.awaited(ns, keys, h, owner, writer))
                      for keys, h in zip(plan, held)]

    def hold_awaited(self, waiting: list[Reservation]) -> None:
        """A commit stored keys the reservations ``waiting`` await: each such block now
        in DRAM is pinned for each of them, a key ``held`` (as ``pin_held``'s), so that
        no eviction before their commits leaves a gap in their chains."""
        for r in waiting:
            get = r.ns.blocks.get
            found = [(i, block) for i in sorted(r.awaited)
                     if (block := get(r.keys[i])) is not None and block.offset is not None]
            if not found:
                continue
            for i, block in found:
                self.store.pin_block(block)
                r.held[i] = block
                r.awaited.discard(i)
            r.held = dict(sorted(r.held.items()))  # by position: unpinned deepest first
            still_awaits(r)

    def unpin_held(self, held: dict[int, Block]) -> None:
        """``pin_held``'s pins go, deepest first (as ``StoreCore.unpin``)."""
        for block in reversed(held.values()):
            self.store.unpin_block(block)


def _awaitable(ws: list[Reservation], mine: set[Reservation], grantee: str | None) -> bool:
    """Whether a key pending in ``ws`` is awaited: none of them ``mine`` (``awaiting``
    the session's own), one of them a writer a reservation of ``grantee`` trusts."""
    return (not any(w in mine for w in ws)
            and any(trusts(grantee, w) for w in ws))


def awaiting(rs: list[Reservation]) -> set[Reservation]:
    """``rs`` and the open reservations that await one of them, directly or through
    others (``Reservation.awaited_by``)."""
    found = set(rs)
    todo = list(rs)
    while todo:
        for other in todo.pop().awaited_by:
            if other not in found:
                found.add(other)
                todo.append(other)
    return found
