"""The namespaces of sessions that ended, closed a slice a loop turn.

A session's end (its lease ran out, its last connection said goodbye) closes every
namespace it had open: each one fewer user, forgotten if that leaves it unused and
empty (``BlockStore.close_namespace``).  Done at once, 1000 namespaces took 1 to 5 ms of
one loop turn, and goodbyes waiting on the socket are read one after another: 50
sessions of 1000 namespaces each saying goodbye held another tenant's pings up to 145
to 190 ms on a busy two-core machine.  The ended session hands its namespace ids over
whole instead (O(1)), each still counted a user, and they are closed at most
``CLOSE_SLICE`` (or ``CLOSE_SLICE_SECONDS``) a loop turn, by turns with the other work
done in slices (``kvstore.slice_turns``): the pings' longest, 13 ms, as with no session
ending on that machine (9 to 13 ms).

While queued, a namespace keeps the user its session counted: it stays in the store,
with its blocks, and counts to its tenant's ``max_namespaces_per_tenant`` (a refusal
meanwhile says closes are queued: they go at several hundred thousand a second while
the loop has nothing else to do, 50k in 66 ms); a session that opens it again
meanwhile adds its own user, and it stays open when the queued close comes.  ``check`` counts the queued closes as users.  A daemon
that stops closes the rest at once (``finish``), no request being served then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvstore.slice_turns import SliceTurns
from kvstore.store import BlockStore

CLOSE_SLICE = 2048
CLOSE_SLICE_SECONDS = 0.001


class NamespaceCloses:
    """The closes queued by sessions that ended, oldest first: each session's namespace
    ids as it left them (handed over whole, so a session's end costs O(1) here; queued
    one by one, 1000 of them took 1 to 5 ms, and 50 goodbyes in a row as long again)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        # (the tenant of the session that ended, its namespace ids: most are its own
        # tenant's, a grantee's may be another's)
        self.queued: deque[tuple[str, set[bytes]]] = deque()
        self.count = 0
        self.by_tenant: dict[str, int] = {}  # queued closes, by the sessions' tenant
        # called when closes are queued and no ``run`` is under way: the daemon drains
        # them (``run``; one that failed is started again by the next queued)
        self.wake: Callable[[], object] | None = None
        self.running = False

    def __repr__(self) -> str:
        return f"NamespaceCloses(queued={self.count}, sessions={len(self.queued)})"

    def __len__(self) -> int:
        return self.count

    def queue(self, tenant: str, ids: set[bytes]) -> None:
        """Close the namespaces ``ids`` (taken over: each open once more, by a session
        of ``tenant`` that ended) later."""
        if not ids:
            return
        self.queued.append((tenant, ids))
        self.count += len(ids)
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + len(ids)
        if not self.running and self.wake is not None:
            self.running = True
            self.wake()

    def step(self, budget: int = CLOSE_SLICE, seconds: float = CLOSE_SLICE_SECONDS) -> bool:
        """Close at most ``budget`` of the queued, for at most about ``seconds``; True
        once none is left."""
        queued, namespaces, close = self.queued, self.store.namespaces, self.store.close_namespace
        deadline = time.perf_counter() + seconds
        while queued and budget > 0:
            tenant, ids = queued[0]
            closed = 0
            while ids and closed < budget:
                ns = namespaces.get(ids.pop())  # (a user counted: still the store's)
                if ns is not None:
                    close(ns)
                closed += 1
                if not closed & 63 and time.perf_counter() >= deadline:
                    budget = closed
            if not ids:
                queued.popleft()
            budget -= closed
            self.count -= closed
            left = self.by_tenant[tenant] - closed
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]
        return not queued

    def finish(self) -> None:
        """Close all that are left, at once."""
        while not self.step(self.count or 1, float("inf")):
            pass

    async def run(self, turns: SliceTurns) -> None:
        """Close what is queued, a slice a loop turn by turns, until none is left."""
        self.running = True
        try:
            while self.queued:
                await turns.turn()
                self.step()
        finally:
            self.running = False

    def users(self) -> dict[bytes, int]:
        """The users the queued closes count, by namespace id (for the invariant check)."""
        counts: dict[bytes, int] = {}
        for _, ids in self.queued:
            for ns_id in ids:
                counts[ns_id] = counts.get(ns_id, 0) + 1
        return counts

    def check(self) -> None:
        """The counts sum the queue, and each queued namespace is the store's (its
        session's user still counted; a grantee's session queues another tenant's)."""
        counts: dict[str, int] = {}
        namespaces = self.store.namespaces
        for tenant, ids in self.queued:
            assert ids, f"{self}: an empty set queued"
            for ns_id in ids:
                assert ns_id in namespaces, f"a queued close of {ns_id!r}, forgotten"
            counts[tenant] = counts.get(tenant, 0) + len(ids)
        assert counts == self.by_tenant, f"{self} counts {self.by_tenant}; queued {counts}"
        assert self.count == sum(counts.values()), f"{self}: queued {counts}"
