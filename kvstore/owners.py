"""Who holds what, and for how long: owners' leases.

A session (an *owner*) renews one lease with every request; its reservations and pins
share it.  When the lease ends, or the session goes, everything it holds is rolled back.
"""

from __future__ import annotations

from kvstore.blocks import Owner, OwnerState, Reservation
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
