"""Requests that finish later: moves to carry out first, or a reply still to come.

A verb answers with a plan (``kvstore.plans``) when bytes must move between tiers or
room must free first, or with ``Later`` when its reply comes from a coroutine; the
server's dispatch hands either to ``Finisher.finish`` in a task, which has the mover
pipeline carry the plan out, runs the request again, and sends its one reply.  Deferred
requests (the pressure chain's ``defer``) wait for room, in order, until their deadline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from kvstore import protocol as p
from kvstore.errors import CapacityError, KVStoreError
from kvstore.pending import Later, Pending
from kvstore.sessions import Session, gone_while_waiting
from kvstore.plans import MAX_TURNS
from kvstore.store import Plan
from kvstore.under_way import FREEING, keys_of
from kvstore.verbs import Answer, Daemon, Handler

log = logging.getLogger("kvstore.server")

# The verbs a full tier may defer (when the pressure chain has "defer").
DEFERRABLE = frozenset({"reserve", "put", "acquire", "get"})
_MAX_ROUNDS = 1000  # plans one request may go through (each a move, or a wake-up)
# Seconds one request may wait for room that writes under way will free: they end within
# a second or two (a batch's write to SSD, a copy into the GPU tier, a send to the remote
# store), but one to a disk that stopped answering never does; the request is refused
# then, its payload let go, not held for its 1000 rounds of half a second
ROOM_COMING_SECONDS = 30.0


class Finisher:
    """Runs requests' attempts, and finishes in a task those that must wait."""

    def __init__(self, host: Daemon) -> None:
        self.d = host
        # sessions with a request whose bytes are moving (a read from the remote store
        # or SSD, writes for room) or whose reply a coroutine makes, and how many: their
        # leases are kept (``kept_alive``), for a client waiting on its reply sends
        # nothing else; a remote read longer than the lease ended the session under it.
        # A request waiting for room (deferred) keeps nothing: a client gone meanwhile
        # takes none when room comes
        self._working: dict[str, int] = {}

    def kept_alive(self, now: float) -> float:
        """Renew the leases of the sessions with requests under way; ``now``."""
        store = self.d.store
        for owner in self._working:
            if owner in store.owners:
                store.touch_owner(owner, now)
        return now

    @contextlib.contextmanager
    def _under_way(self, session: Session) -> Iterator[None]:
        working = self._working
        working[session.id] = working.get(session.id, 0) + 1
        try:
            yield
        finally:
            if working[session.id] > 1:
                working[session.id] -= 1
            else:
                del working[session.id]

    def attempt(self, handler: Handler, session: Session, request: Any,
                payload: list[Any], verb: str, *, early: bool) -> Answer:
        """Run a handler; ``early``: a request that may still defer makes room only by
        the pressure steps before "defer"."""
        store = self.d.store
        store.early = early and self.d.defer and verb in DEFERRABLE
        try:
            return handler(session, request, payload)
        finally:
            store.early = False

    def hold(self, session: Session, request: Any, payload: list[Any],
             answer: Pending, verb: str = "") -> None:
        """Count a request that finishes in a task (``finish``; ``answer`` its first),
        and its payload's bytes in flight: LimitExceededError past a limit
        (``kvstore.under_way``)."""
        keys = self._counted_keys(request, answer)
        under_way = self.d.under_way
        if keys is not None:
            under_way.take(session, keys, freeing=verb in FREEING)
        try:
            self.d.sessions.hold_bytes(session, sum(len(f) for f in payload))
        except BaseException:
            if keys is not None:
                under_way.give(session, keys, freeing=verb in FREEING)
            raise

    @staticmethod
    def _counted_keys(request: Any, answer: Pending) -> int | None:
        """The keys a request finishing in a task counts under way; None: its work
        counts already (``Later.counted``)."""
        return None if isinstance(answer, Later) and answer.counted else keys_of(request)

    def deferral(self, tenant: str, exc: CapacityError) -> Plan:
        """No room now: a plan to wait for some, in order, until the deadline."""
        d = self.d
        d.scheduling["defers"] += 1
        if d.metrics is not None:
            d.metrics.observe_defer("dram", tenant)
        return Plan(defer_until=d.clock() + d.config.dram.defer_seconds,
                    ticket=d.moves.room.ticket())

    def may_defer(self, verb: str) -> bool:
        return self.d.defer and verb in DEFERRABLE

    def rejected(self, tenant: str, exc: CapacityError) -> None:
        d = self.d
        d.scheduling["rejects"] += 1
        if d.metrics is not None:
            d.metrics.observe_reject("dram", tenant, exc.cause)

    async def finish(self, routing_id: bytes, rid: int, verb: str, tenant: str,
                     start: float, handler: Handler, session: Session, request: Any,
                     payload: list[Any], pending: Pending) -> None:
        """Carry out what the request waits on, run it again (as often as it answers with
        another plan), and send its one reply."""
        d = self.d
        code: str | None = None
        reply: p.Message
        out: list[Any]
        try:
            reply, out = await self._settle(verb, tenant, handler, session, request,
                                            payload, pending)
        except KVStoreError as exc:
            code = exc.code
            reply, out = p.ErrorReply(rid, exc.code, str(exc)), []
            if isinstance(exc, CapacityError):
                self.rejected(tenant, exc)
        except Exception as exc:
            log.exception("internal error finishing a request")
            code = "internal"
            reply, out = p.ErrorReply(rid, "internal", f"internal error: {exc!r}"), []
        try:
            d.sessions.release_bytes(session, sum(len(f) for f in payload))
            if (keys := self._counted_keys(request, pending)) is not None:
                d.under_way.give(session, keys, freeing=verb in FREEING)
            d.sessions.counted(session)
        finally:  # (the one reply goes whatever the bookkeeping did: a client waited)
            d.transport.send(routing_id, reply, out)
        d.policy_switches.after_request()  # (as ``Server._on_message`` after a reply)
        if d.metrics is not None:
            d.metrics.observe_request(verb, time.perf_counter() - start, code, tenant)
        if d.debug_invariants:
            d.check_invariants()

    async def _settle(self, verb: str, tenant: str, handler: Handler, session: Session,
                      request: Any, payload: list[Any],
                      pending: Pending) -> tuple[p.Message, list[Any]]:
        rounds = turns = 0
        room = self.d.moves.room
        # the deferral the request waits in, kept once made, across every plan after it
        # (a slab taken, room coming waited for, its own demotions, and still short: it
        # waits on in its place until its deadline, not refused at the next attempt)
        deferral: Plan | None = None
        room_since: float | None = None  # when it began to wait for room coming
        # its place in the line for room, from its first wait for some (room coming, or
        # deferred); ``woken``: a wait of it ended by a wake it has not passed on
        place: int | None = None
        woken = False

        def pass_wake_on() -> None:
            # woken for room, it takes none (still short, or refused): the next younger
            # waiter may fit what freed.  Before, a request woken while it waited for
            # room coming kept the wake, and the waiters behind it, the room free,
            # waited until the next release or their deadline
            nonlocal woken
            if woken and place is not None:
                room.freed(after=place)
            woken = False

        while rounds < _MAX_ROUNDS:
            if isinstance(pending, Plan) and pending.turn and turns < MAX_TURNS:
                turns += 1  # (a turn comes after progress: not one of the rounds)
            elif pending is not deferral and not (isinstance(pending, Plan)
                                                  and pending.room_coming):
                # (waiting again, for room or for room coming: its deadline, or
                # ``ROOM_COMING_SECONDS``, bounds that; every wake-up of it counted, 1000
                # ended it in 0.17 s, or, woken by each send of the remote store's, in 5 s)
                rounds += 1
            if isinstance(pending, Later):
                pass_wake_on()  # (its room taken, or none needed: the next may fit)
                # what an attempt here took before its reply went to a coroutine (a put's
                # reservation, once room was made) counts to the session while it waits,
                # as after the first attempt: else the invariant check after another
                # request meanwhile, and the tenant's caps, missed it
                self.d.sessions.counted(session)
                with self._under_way(session):
                    made = await pending.reply
                return made if isinstance(made, tuple) else (made, [])
            plan = pending
            if plan.defer_until is not None:
                deferral = plan
            if not plan.room_coming:
                room_since = None  # (progress: a later wait is timed from its start)
            else:
                now = self.d.clock()
                room_since = now if room_since is None else room_since
                if now - room_since > ROOM_COMING_SECONDS:
                    pass_wake_on()
                    raise CapacityError(
                        f"no room in the dram tier: the writes that were to free it did not "
                        f"end within {ROOM_COMING_SECONDS:g}s", cause="deadline")
            waits = plan.room_coming or plan is deferral
            if waits:  # a wait for room, in its place in line: what it was woken for first
                pass_wake_on()
                if place is None:
                    place = plan.ticket or room.ticket()
                plan.ticket = place
            try:
                if plan.defer_until is None:
                    with self._under_way(session):
                        await self.d.moves.carry_out(plan)
                else:
                    await self.d.moves.carry_out(plan)
            except CapacityError as exc:
                # no room to move the blocks into (DRAM full of pins, say): defer as the
                # first attempt would have, if the pressure chain allows it, or wait on
                # in the deferral it had until its deadline.  (A plan that fails wakes the
                # next waiter itself, ``Moves.carry_out``: not woken twice here)
                woken = False
                if plan is deferral or not self.may_defer(verb) or (
                        deferral is not None and deferral.expired):
                    raise
                pending = deferral = deferral or self.deferral(tenant, exc)
                continue
            except BaseException:
                pass_wake_on()  # (a fetch that found nothing, say: it takes no room)
                raise
            if waits:
                woken = not plan.expired
            if (deferral is not None and not deferral.expired
                    and self.d.clock() >= (deferral.defer_until or 0.0)):
                # its deadline passed while it waited on another plan (room coming): the
                # steps after "defer" run now, as they would have at the deadline
                deferral.expired = True
            if session.id not in self.d.sessions.by_id:
                # its lease ran out while it waited (for room, or for the writes that
                # make it): run again, it found its namespaces closed with the session
                # and answered that it never opened them, which its client took for a
                # session still there.  Woken for room it takes none: the next may
                pass_wake_on()
                raise gone_while_waiting(session)  # (or it said goodbye meanwhile)
            try:
                # until its deadline a deferred request runs only the steps before "defer";
                # then, once, the steps after it too
                answer = self.attempt(handler, session, request, payload, verb,
                                      early=not (deferral is not None and deferral.expired))
            except CapacityError as exc:
                pass_wake_on()
                if deferral is None:
                    if not self.may_defer(verb):
                        raise
                    # refused by the steps before "defer" after a plan (room coming
                    # came, its own demotions written, and others took the room):
                    # deferred as its first attempt would have been.  Before, it was
                    # refused outright, the pressure chain's "defer" and any steps
                    # after it never tried
                    pending = deferral = self.deferral(tenant, exc)
                    continue
                if deferral.expired:
                    self.d.scheduling["defer_timeouts"] += 1
                    raise CapacityError(
                        f"no room in the dram tier within "
                        f"{self.d.config.dram.defer_seconds:g}s (deferred, then rejected): "
                        f"{exc}", cause="deadline") from None
                # still no room: the next younger waiter may fit what freed (passed on
                # above), then this waits again, in its place, until the deadline
                pending = deferral
                continue
            except BaseException:
                # woken for room, refused for another reason (its namespace closed while
                # it waited, its parent evicted): it takes none, so the next waiter may
                pass_wake_on()
                raise
            if isinstance(answer, tuple):
                if len(room):
                    self.d.moves.freed()  # woken for room and served: wake the next one
                return answer
            pending = answer
        if isinstance(pending, Plan):
            self.d.moves.abandon(pending)  # planned, never carried out: its marks go
        else:  # a reply to come, never run: what its attempt took goes back now
            pending.reply.close()
            pending.gave_up()
        raise CapacityError("blocks kept moving between tiers; try again")
