"""Commits that wait for the older writers of the keys they were given no slot for.

A reserve with ``skip_held`` gives no slot to a key another session's open reservation
holds one for (``Reservation.awaited``): that writer's bytes are coming.  Two engines
saving the same prefix, each with its own continuation: the second copies only its own
tail and often commits first, and a commit that found the shared keys not cached yet
stored none of them nor its own blocks after them.  So its commit waits until every
reservation it awaits has ended (committed, aborted, or rolled back at its lease's
end), then commits by the store's rule: a key the other writer stored was pinned for it
at that commit (``Leases.hold_awaited``), one it did not store ends the chain there.

The waits point only to older reservations of other sessions, so they make no cycle
among reservations.  They may among sessions: a blocking client commits one reservation
at a time, so a session whose commit waits commits none of its other reservations till
then.  Two clients each holding two reservations, each one's younger awaiting a key of
the other's older, each committing its younger first: both commits waited out the
bound.  Where a commit's wait would close such a cycle (its writers' sessions wait,
through others, for its own: ``closes_cycle``), one commit of the cycle goes on at once
(``cycle_breaker``: the one losing fewest blocks of its own bytes, this one on a tie):
it stores what is cached and drops the rest, as at the bound; its client then commits
its older reservation, which wakes the others.  (An asynchronous client may send that
commit right behind, ending the cycle: so a cycle is judged only once the requests read
with the commit, and those read within ``CYCLE_GRACE`` after, have run.  A drop is still
possible where that commit comes later; a stall of the bound for every blocking client
is the dearer loss.)  A wait is still bounded, by
half a lease from when the commit came and at most ``WAIT_MOST`` (a writer's client
may hold a reservation open while its session lives on, or be killed, its session
ending with its lease; a client's timeout must not run out first: 30 s by default, but
5 s the vLLM connector's and 10 s the SGLang and LMCache ones', whose link, timed out,
backs off and drops its session); a writer gone silent is rolled back at its lease's
end, which wakes the waiter.  A session whose reservation a wait ran out on (its own
commit waiting for none) is awaited by no reserve for a lease, and no commit waiting for
it waits on (``Leases.overdue``):
one holding a reservation open while renewing its lease made every commit of every peer
saving that prefix wait out the bound, for as long as it lived.  Meanwhile the waiter's lease is renewed, as for every
request finishing in a task (``Finisher.kept_alive``).
A waiter's own session ending (a goodbye, its lease) ends its wait with that error; the
daemon stopping ends every wait, as no writer's commit is read any more.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable
from typing import Any

from kvstore import protocol as p
from kvstore.errors import MalformedError
from kvstore.pending import Later
from kvstore.sessions import Session, Sessions, gone_while_waiting
from kvstore.store import BlockStore, Owner, Reservation, commit_runs

Outcome = tuple[p.Message, list[Any]]
WAIT_SHARE = 0.5  # of a lease: the longest a commit waits for older writers
WAIT_MOST = 2.5  # seconds, whatever the lease: half the engines' shortest timeout
# seconds a commit whose wait would close a cycle lets the requests sent right behind it
# be read (a drain's slice, twice) before it is judged again: a pipelining client's
# commit of its older reservation may end the cycle
CYCLE_GRACE = 0.004
# waiting commits tried as a cycle's breaker, fewest blocks lost first: each try walks
# every waiting commit, and trying all, a few sessions' hundreds of waiting commits held
# the loop seconds in all
CYCLE_CANDIDATES = 8


class CommitWaits:
    """The commits waiting for older writers, by reservation."""

    def __init__(self, store: BlockStore, sessions: Sessions) -> None:
        self.store = store
        self.sessions = sessions
        self.waiting: dict[int, Reservation] = {}
        self.breaking: set[int] = set()  # waiting ones to commit now: each breaks a cycle
        self.stopped = False  # the daemon stops: no writer commits any more, none waits

    def __repr__(self) -> str:
        return f"CommitWaits(waiting={len(self.waiting)}, stopped={self.stopped})"

    def commit(self, session: Session, req: p.Commit,
               commit_now: Callable[[], Outcome]) -> Outcome | Later:
        """``commit_now`` at once, or, while the reservation awaits older writers'
        reservations still open, in a coroutine once they end (``Later``)."""
        r = self._open(session, req.reservation)
        if r is None or not r.awaits or self.stopped:
            return commit_now()  # (an unknown reservation: its error, as before)
        commit_runs(self.store, r, req.checksums, req.token_ids or req.tokens)  # (checked)
        if r.id in self.waiting:  # (the second would take the first one's wake-up)
            raise MalformedError(f"a commit of reservation {r.id} is waiting already for "
                                 f"the older writers of its keys; commit it once")
        self.waiting[r.id] = r  # (now: the coroutine may run after the next request)
        return Later(self._after_writers(session, r, commit_now),
                     give_up=lambda: self._done(r))

    def _open(self, session: Session, rid: int) -> Reservation | None:
        state = self.store.owners.get(session.id)
        return None if state is None else state.reservations.get(rid)

    def _done(self, r: Reservation) -> None:
        r.wake = None
        self.breaking.discard(r.id)
        if self.waiting.get(r.id) is r:
            del self.waiting[r.id]

    async def _after_writers(self, session: Session, r: Reservation,
                             commit_now: Callable[[], Outcome]) -> Outcome:
        try:
            if self._waits(session, r) and self._closes(r):  # (the requests sent right
                await asyncio.sleep(CYCLE_GRACE)  # behind it read first, maybe ending it)
            if self._waits(session, r) and not self._breaks_cycle(r):
                woken = asyncio.get_running_loop().create_future()

                def wake() -> None:
                    if not woken.done():
                        woken.set_result(None)

                r.wake = wake
                self.store.counters.commits_waited += 1
                try:
                    bound = min(self.store.limits.lease_seconds * WAIT_SHARE, WAIT_MOST)
                    await asyncio.wait_for(woken, bound)
                except TimeoutError:  # a writer holding its reservation open: not waited
                    self.store.counters.commit_wait_timeouts += 1  # for again, a lease long
                    self.store.leases.overdue(self._stuck(r), self.sessions.clock())
        finally:
            self._done(r)
        if session.id not in self.sessions.by_id:  # (a goodbye, or its lease, meanwhile:
            raise gone_while_waiting(session)  # its reservation was rolled back)
        return commit_now()

    def _breaks_cycle(self, r: Reservation) -> bool:
        """Whether ``r``'s commit goes on at once, not waiting: it was picked to break a
        cycle, or its wait would close one and it is the ``cycle_breaker`` (else the one
        picked is woken).  Judged as its coroutine starts, once the requests read with
        its commit have run: a client pipelining its commits sends its older
        reservation's right behind, which may end the cycle; judged on arrival, its
        younger one went on, dropping its blocks after the keys awaited, for nothing."""
        if r.id in self.breaking:
            return True
        if not self._closes(r):
            return False
        waiting = self._others(r)
        self.store.counters.commit_wait_cycles += 1
        breaker = cycle_breaker(r, waiting)
        self.breaking.add(breaker.id)  # (it waits for nobody now: others' cycles skip it)
        if breaker is r:
            return True  # (what is cached stored, the rest dropped)
        if breaker.wake is not None:  # (else it goes on as its coroutine starts)
            breaker.wake()
        return False

    def _waits(self, session: Session, r: Reservation) -> bool:
        """Whether ``r``'s commit has writers to wait for: still open, awaiting some."""
        return bool(r.awaits) and not self.stopped and self._open(session, r.id) is r

    def _others(self, r: Reservation) -> list[Reservation]:
        """The commits waiting but ``r``'s, less those going on (they wait for nobody)."""
        return [w for w in self.waiting.values() if w is not r and w.id not in self.breaking]

    def _closes(self, r: Reservation) -> bool:
        """Whether ``r``'s commit, waiting, would close a cycle of sessions now."""
        return r.id not in self.breaking and closes_cycle(r, self._others(r))

    def _stuck(self, r: Reservation) -> set[Owner]:
        """The sessions of the writers ``r`` still awaits that hold their reservations open
        of their own accord: none whose own commit waits (it waits for another writer,
        whose session is the one to blame, once that commit's wait runs out)."""
        waiting = {w.owner for w in self.waiting.values()}
        return {w.owner for w in r.awaits if w.owner not in waiting}

    def stop(self) -> None:
        """The daemon stops reading requests: the waiting commits go on at once."""
        self.stopped = True
        for r in list(self.waiting.values()):
            if r.wake is not None:
                r.wake()


def closes_cycle(r: Reservation, waiting: Iterable[Reservation]) -> bool:
    """Whether ``r``'s commit, waiting, would close a cycle of sessions waiting for each
    other: a session whose commit waits (one of ``waiting``) commits none of its other
    reservations till its reply, so it waits for the sessions of the reservations that
    commit awaits; ``r``'s session would wait for those of ``r.awaits``."""
    if not waiting:
        return False
    by_owner: dict[Owner, list[Reservation]] = {}
    for w in waiting:
        by_owner.setdefault(w.owner, []).append(w)
    seen = {r.owner}
    todo = [r]
    while todo:
        for writer in todo.pop().awaits:
            if writer.owner == r.owner:
                return True
            if writer.owner not in seen:
                seen.add(writer.owner)
                todo += by_owner.get(writer.owner, ())
    return False


def cycle_breaker(r: Reservation, waiting: list[Reservation]) -> Reservation:
    """The commit to go on at once where ``r``'s wait would close a cycle (``closes_cycle``):
    of ``r`` and the ``waiting`` whose end opens every cycle through ``r``'s session, the
    one whose commit now throws away fewest blocks of its own bytes (``own_lost``); ``r``
    on a tie.  (A key it awaits is no loss: its writer stores it once its session goes
    on.)  Only the ``CYCLE_CANDIDATES`` waiting commits losing fewest are tried."""
    lost = own_lost(r)
    if not lost:
        return r
    fewest = heapq.nsmallest(CYCLE_CANDIDATES, ((own_lost(w), i) for i, w in
                                                enumerate(waiting)))
    for w_lost, i in fewest:  # (the first to open every cycle loses fewest)
        if w_lost >= lost:
            break
        w = waiting[i]
        if not closes_cycle(r, [x for x in waiting if x is not w]):
            return w
    return r


def own_lost(r: Reservation) -> int:
    """The blocks given a slot in ``r`` (its writer's bytes) that its commit now would not
    store: those after its first awaited key not cached."""
    get = r.ns.blocks.get
    for i in sorted(r.awaited):
        block = get(r.keys[i])
        if block is None or not block.present:
            return sum(1 for j in range(i + 1, len(r.keys))
                       if j not in r.held and j not in r.awaited)
    return 0
