"""Evict and drop: waiting for the get replies still being sent of the namespace's
blocks, removals too big for one loop turn done a slice a turn, and the sweep below
hollow entries a slice a turn (``Removals``, which the verbs hand those requests to).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from kvstore import protocol as p
from kvstore.core import Keeping, SubtreeDrop
from kvstore.index import NamespaceDrop
from kvstore.moves import Moves
from kvstore.pending import Later, Pending
from kvstore.slice_turns import SliceTurns
from kvstore.store import BlockStore, Namespace
from kvstore.transport import Transport

Outcome = tuple[p.Message, list[Any]]
Answer = Outcome | Pending


class Daemon(Protocol):
    """What removals use of the daemon."""

    @property
    def store(self) -> BlockStore: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def moves(self) -> Moves: ...
    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...

GET_OWNER = ("daemon", "get")  # pins held while zero-copy get frames are in flight
# A namespace of more blocks than this is dropped in slices of at most ``DROP_SLICE``
# entries or ``DROP_SLICE_SECONDS``, whichever comes first, a loop turn each; an evict
# whose first such slice does not reach the end goes on in slices too.  A millisecond,
# not two: a client's request that comes meanwhile waits for the rest of a slice (the
# loop's longest hold in a 400k-block drop or evict, median of 3 runs of
# ``benchmarks/loop_stalls.py``: 2.3 -> 1.2 ms), and the removal took no more CPU.
DROP_AT_ONCE = 256
DROP_SLICE = 4096
DROP_SLICE_SECONDS = 0.001


class Slices(Protocol):
    """A removal done a slice a loop turn (``NamespaceDrop``, ``SubtreeDrop``)."""

    @property
    def count(self) -> int: ...

    def step(self, budget: int, seconds: float = ...) -> bool: ...

    def take_removed(self) -> list[tuple[bytes, bytes]]: ...

    def close(self) -> None: ...


class Removals:
    """What evict and drop share: waiting for the get replies still being sent; the
    drops of namespaces of more than ``DROP_AT_ONCE`` blocks, and the evicts of
    subtrees too big for one slice, in slices; and the sweep below hollow entries
    (``StoreCore.sweep_hollow``), a slice a loop turn.

    Each slice drops at most ``DROP_SLICE`` entries or runs ``DROP_SLICE_SECONDS``, then
    the loop turns for everyone else; the reply goes when the last slice is done.
    ``NamespaceDrop`` says what a drop takes while the store changes around it: what the
    namespace held when it began, leaves first, but what is pinned, moving or held and
    their prefixes, and what is committed after it was asked for (the store's commit
    keeps it: ``StoreCore.keep_commits``, taken with the request, before any wait).  An
    evict in slices (``SubtreeDrop``) takes what its keys head, on the same terms.
    Lookups meanwhile see chains shortened from their ends.  Removals in slices of one
    namespace run one after another: a second one waits for the first, then drops what
    is left of what was there when it was asked for (what was committed between the
    two requests, the first kept, the second takes), and counts only what it removed
    itself.  An evict's first slice runs at once (a small subtree is answered there and
    then).  A small drop that must wait (for get replies, or another removal) waits as
    one in slices, and keeps what is committed meanwhile in the same way.  The
    session may close meanwhile: the removal goes on to its end (the reply finds no
    one).  A daemon shutting down waits for it as for any request under way; cut short,
    it leaves what it has not reached, each slice having left the store whole.
    """

    def __init__(self, daemon: Daemon,
                 sending: dict[int, tuple[Any, int]] | None = None) -> None:
        self.d = daemon
        # zero-copy get replies being sent: pin id -> (the session asking, bytes); an
        # evict or drop waits for its own session's only (None: every session's)
        self.sending = sending
        # namespaces being removed from in slices: an event set once that is over
        self.under_way: dict[Namespace, asyncio.Event] = {}
        # the loop turns of the work done in slices, its slices one a turn over all of it
        # (removals, whole snapshots, large puts): ``kvstore.slice_turns``
        self.turns = SliceTurns()
        self._sweep: asyncio.Task[None] | None = None
        daemon.store.sweep_later = self._sweep_later

    def drop(self, rid: int, ns: Namespace, session: object = None) -> Answer:
        store = self.d.store
        if len(ns.blocks) > DROP_AT_ONCE or ns in self.under_way or self._sending_in(ns, session):
            keeping = store.keep_commits(ns)  # (now: what it waits for, it keeps)
            return self._later(self._in_slices(
                rid, ns, lambda: NamespaceDrop(store, ns, keeping), keeping, session), keeping)
        return self._removed(rid, lambda: store.drop_namespace(ns))

    def evict(self, rid: int, ns: Namespace, keys: list[bytes],
              session: object = None) -> Answer:
        """Drop what the keys head: a slice at once (unless replies are still being
        sent), the rest, if any, in slices."""
        drop = SubtreeDrop(self.d.store, ns, keys)
        if not self._sending_in(ns, session):
            done = drop.step(DROP_SLICE, DROP_SLICE_SECONDS)
            withdrawing = self._hand_on(drop)
            if done:
                return self._answer(rid, drop.count, withdrawing)
            self._room_freed(drop, 0)  # (its reply comes later: the server wakes none)
        # before the reply returns to the loop: what is committed from now on, while it
        # waits (for replies, another removal of the namespace) and goes on, is kept
        keeping = drop.keep_commits()
        return self._later(self._in_slices(rid, ns, lambda: drop, keeping, session), keeping)

    @staticmethod
    def _later(reply: Coroutine[Any, Any, p.Message], keeping: Keeping) -> Later:
        """The reply of a removal that keeps commits (``keeping``): it ends with the
        coroutine, or, if that is closed before it ever ran (a request given up before
        its task started), when the server says so (``Later.gave_up``), or else once
        the coroutine is gone (the finalizer: the backstop for any other way it is
        dropped unrun, such as a task cancelled before it started)."""
        weakref.finalize(reply, keeping.close)
        return Later(reply, keeping.close)

    def _sending_in(self, ns: Namespace, session: object = None) -> list[Any]:
        """The get replies ZeroMQ is still sending of ``ns``'s blocks (a get's blocks
        are of one namespace) to ``session``: another namespace's, or another
        session's (a grantee's that never reads), however many, are no reason to wait:
        it is the asker's own get, read already, that must not keep its blocks."""
        if not self.d.transport.sending():  # (reaps those sent)
            return []
        held = self.d.store.owners.get(GET_OWNER)
        if held is None:
            return []
        sending = self.sending
        pins = {pin_id for pin_id, pin in held.pins.items()
                if pin.blocks and pin.blocks[0].ns is ns
                and (sending is None or session is None
                     or sending.get(pin_id, (None, 0))[0] is session)}
        return self.d.transport.trackers_of(pins) if pins else []

    def _removed(self, rid: int,
                 remove: Callable[[], tuple[int, list[tuple[bytes, bytes]]]]) -> Answer:
        count, removed = remove()
        self.d.moves.removed(removed)
        return self._answer(rid, count, bool(removed))

    def _answer(self, rid: int, count: int, withdrawing: bool) -> Answer:
        """The count, once the SSD index no longer holds the copies that went (a reply
        before it, and a crash, and the next start restored what the client was told
        was gone)."""
        if not withdrawing:
            return p.CountReply(rid, count), []
        if count:  # (its reply comes later: the server wakes none)
            self.d.moves.freed()
        # not counted under way: the removal is done, and a bound refusing its reply
        # told the client limit_exceeded ("nothing is started"), its blocks gone (a
        # session with its reserves waiting for that room, at every evict).  A task
        # each removal of SSD copies: bounded by the copies there were
        return Later(self._once_withdrawn(rid, count), counted=True)

    async def _once_withdrawn(self, rid: int, count: int) -> p.Message:
        await self.d.moves.withdrawn()
        return p.CountReply(rid, count)

    def _hand_on(self, drop: Slices) -> bool:
        """Withdraw the SSD copies the removal dropped since the last call; whether any."""
        removed = drop.take_removed()
        if removed:
            self.d.moves.removed(removed)
        return bool(removed)

    def _room_freed(self, drop: Slices, before: int) -> None:
        """A slice of a removal answered later removed blocks (``drop.count`` past
        ``before``): wake what waits for room now.  The server wakes the waiters after
        a removal answered at once only; one in slices freed DRAM and woke no one, so
        the requests deferred behind a full DRAM waited out their deadline, the room
        free (an evict whose first slice ran past its millisecond, a drop of more than
        ``DROP_AT_ONCE`` blocks)."""
        if drop.count > before:
            self.d.moves.freed()

    async def _in_slices(self, rid: int, ns: Namespace, begin: Callable[[], Slices],
                         keeping: Keeping, session: object = None) -> p.Message:
        d = self.d
        try:
            sending = self._sending_in(ns, session)  # (they would keep their blocks)
            if sending:
                await d.transport.sent(sending)
            while (ahead := self.under_way.get(ns)) is not None:
                await ahead.wait()
        except BaseException:
            keeping.close()  # (given up before it began)
            raise
        finished = asyncio.Event()
        self.under_way[ns] = finished
        drop: Slices | None = None
        try:
            drop = begin()
            while True:
                await self.turns.turn()  # (a turn of its own: the others' slices first)
                before = drop.count
                done = drop.step(DROP_SLICE, DROP_SLICE_SECONDS)
                self._hand_on(drop)
                self._room_freed(drop, before)
                if done:
                    break
            count = drop.count
        finally:
            if drop is not None:
                drop.close()
            keeping.close()
            del self.under_way[ns]
            finished.set()
        # (an evict's first slice, handed on before, too; the next removal of the
        # namespace need not wait for it)
        await self.d.moves.withdrawn()
        return p.CountReply(rid, count)

    def _sweep_later(self) -> None:
        """The store's sweep below hollow entries stopped short: go on a loop turn later
        (one task at a time), until a call finishes the round."""
        if self._sweep is not None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (the daemon is gone): nothing to hold, finish now
            store = self.d.store
            store.sweep_later = None
            try:
                store.sweep_hollow()
            finally:
                store.sweep_later = self._sweep_later
            return
        self._sweep = self.d.spawn(self._sweeping())

    async def _sweeping(self) -> None:
        store = self.d.store
        try:
            done = False
            while not done:
                await asyncio.sleep(0)  # a loop turn for everyone else
                done = store.sweep_hollow()
                if store.dropped_ssd:
                    self.d.moves.removed(store.dropped_ssd)
                    store.dropped_ssd = []
        finally:
            self._sweep = None
