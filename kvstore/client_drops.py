"""What a client sends without waiting for the reply, and what it gives back unasked.

The part of a session (``client_core.SessionCore``) that keeps its request ids and
its requests posted without waiting (a release: their replies are read later and
settled here), and gives back what no caller will:

- what the late reply to a request its caller gave up on holds (a timeout, a
  cancellation, a Ctrl-C): ``_abandon``, then ``_give_back`` when the reply comes;
- the holding of a pin or reservation object dropped unreleased, garbage-collected
  without ``release()``, ``commit()`` or ``abort()`` (an exception path in the
  caller's code, a forgotten call), which stayed held in the daemon for the whole
  session before.  Its ``__del__`` only notes it (``Drops.note``): a finalizer runs in
  whatever thread the collector runs in, in the middle of another call of the same
  client, or after its close, and a ZeroMQ socket serves one thread at a time.  The
  client posts the release or abort at its next call, just before that call's request
  (the daemon serves a connection's requests in order, so that request sees them
  done), and at its close: ``_dropped_requests``.

No I/O here: the shells send what this builds.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

from kvstore import protocol as p
from kvstore.errors import BufferInUseError

log = logging.getLogger("kvstore.client")

_ABANDONED_MEMORY = 1 << 12  # requests given up on, remembered for their late replies


def let_go(buffers: list[memoryview], what: str) -> None:
    """Release the views of an object's slots as its release, commit or abort goes out;
    refused (``BufferInUseError``) while any is exported (a buffer taken of it by C
    code, as ``PyObject_GetBuffer`` takes one), and then the object still holds its pin
    or slots, so the call may be made again once the export ends; its views that were
    not exported are let go all the same.  Before, the object was marked released (or
    done) first, so the release or abort was never sent, and the pin or slots stayed
    held for the session's life.  (An array made over a view, as numpy's and torch's
    ``frombuffer`` make one, takes no export of it: nothing tells it apart, and it must
    not outlive the release.)"""
    exported = 0
    for buf in buffers:
        try:
            buf.release()  # (a view released already: nothing)
        except BufferError:
            exported += 1
    if exported:
        raise BufferInUseError(
            f"{what}: {exported} of its {len(buffers)} buffers are still exported (C "
            f"code holds a buffer of it): let that go, then ask again; it stays held "
            f"meanwhile, its other views let go")


class Drops:
    """Holdings whose objects were dropped unreleased, queued by their finalizers for
    the client's next call (from any thread: a deque's append and popleft are atomic),
    and how many so far: ``given_back`` (released or aborted, or gone with the
    session), ``kept`` (one of its buffers was still exported, C code holding it as it
    reads or writes the slot: the holding stays until the session ends, as before, so
    that the slot is not reused under it)."""

    def __init__(self) -> None:
        # (a pin, not a reservation; given back, not kept; its id)
        self._queue: deque[tuple[bool, bool, int]] = deque()
        self.given_back = 0
        self.kept = 0

    def note(self, pin: bool, ident: int, buffers: list[memoryview]) -> None:
        """A finalizer's: the pin or the reservation ``ident`` of an object dropped
        unreleased.  Its buffers are released here, as an explicit release does (a
        view kept past its object is refused from then on, not read as another block's
        bytes; an array made over one, which takes the arena's memory rather than the
        view, must not outlive the object, as after a release).  Queued only: no send,
        no lock, no log here."""
        give_back = True
        for buf in buffers:
            try:
                buf.release()
            except BufferError:  # exported: the slot must stay held
                give_back = False
        self._queue.append((pin, give_back, ident))

    def __bool__(self) -> bool:
        return bool(self._queue)

    def take(self) -> list[tuple[bool, bool, int]]:
        """Every holding noted so far, oldest first: (a pin, given back, its id)."""
        taken = []
        while True:
            try:
                taken.append(self._queue.popleft())
            except IndexError:
                return taken

    def __repr__(self) -> str:
        return (f"Drops(given_back={self.given_back}, kept={self.kept}, "
                f"queued={len(self._queue)})")


class GivingBack:
    """A session's request ids, its requests posted without waiting, and what it gives
    back that no caller will (see the module's doc)."""

    _lost: str  # (the session's: why the daemon has no session for it any more)
    _holding: int  # (the session's: reservations and pins held)

    def __init__(self) -> None:
        # request ids: ``next`` of a count is one step in C, never one id to two threads
        self._rids = itertools.count(1)
        # posted requests whose replies are not read: id -> what was asked (for the log)
        self._unread: dict[int, str] = {}
        # requests whose callers gave up on the reply (a timeout, a cancellation), the
        # oldest forgotten past _ABANDONED_MEMORY
        self._abandoned: dict[int, None] = {}
        self.drops = Drops()  # holdings dropped unreleased, to give back

    def _next_rid(self) -> int:
        return next(self._rids)

    # -- requests posted without waiting (releases) -------------------------------------
    def _posted(self, req: p.Message) -> bytes:
        """The header of a request whose reply nobody waits for: the shell reads that
        reply later and hands it to ``_settle``.  The daemon serves a connection's
        requests in order, so the next request sees it done."""
        self._unread[req.rid] = type(req).__name__.lower()
        return p.encoder.encode(req)

    def _settle(self, reply: p.Message) -> bool:
        """Whether ``reply`` answers a posted request; if so it is dropped here, and a
        refusal logged (there is nobody left to raise it to)."""
        asked = self._unread.pop(reply.rid, None)
        if asked is None:
            return False
        if isinstance(reply, p.ErrorReply):  # (a prefetch past the bound on work under
            quiet = (asked, reply.code) == ("prefetch", "limit_exceeded")  # way: quietly)
            log.log(logging.DEBUG if quiet else logging.WARNING,
                    "the daemon refused a posted %s: %s: %s", asked, reply.code,
                    reply.message)
        return True

    # -- requests given up on -------------------------------------------------------------
    def _abandon(self, rid: int) -> None:
        """The caller of request ``rid`` gave up waiting for its reply: what the reply
        holds, if it comes, is to be given back (``_give_back``)."""
        self._abandoned[rid] = None
        if len(self._abandoned) > _ABANDONED_MEMORY:
            del self._abandoned[next(iter(self._abandoned))]

    def _give_back(self, reply: p.Message) -> list[p.Message]:
        """The requests to post (``_posted``) that give back what a reply nobody takes
        holds: a pin's release, a reservation's abort (else, none: it is dropped)."""
        self._abandoned.pop(reply.rid, None)
        undo: list[p.Message]
        if isinstance(reply, p.AcquireReply) or (isinstance(reply, p.LookupPinReply)
                                                  and reply.pin):
            undo = [p.Release(self._next_rid(), reply.pin)]
        elif isinstance(reply, p.ReserveReply):
            undo = [p.Abort(self._next_rid(), reply.reservation)]
        elif isinstance(reply, p.BatchReply):
            undo = [p.Abort(self._next_rid(), r) for r in reply.reservations]
        else:
            return []
        log.info("giving back what a reply nobody waited for holds (%s)", type(reply).__name__)
        return undo

    # -- holdings dropped unreleased ------------------------------------------------------
    def _dropped_requests(self) -> list[p.Message]:
        """The releases and aborts that give back the holdings of objects dropped
        unreleased since the last call, counted and logged; for the shell to post (from
        the thread that holds the socket) before its next request, or at close.  None
        once the session is gone: the daemon took them with it."""
        taken = self.drops.take()
        if not taken:
            return []
        back = [(pin, ident) for pin, give_back, ident in taken if give_back]
        self._holding -= len(back)
        self.drops.given_back += len(back)
        self.drops.kept += len(taken) - len(back)
        log.warning("%d pin(s) or reservation(s) of this client were dropped without "
                    "release(), commit() or abort() (garbage-collected): %d given back "
                    "now%s; release them explicitly, or use them in a with block",
                    len(taken), len(back), "" if len(back) == len(taken) else
                    ", the rest kept (a buffer of theirs is still in use) until the "
                    "session ends")
        if self._lost:
            return []
        return [p.Release(self._next_rid(), ident) if pin else p.Abort(self._next_rid(), ident)
                for pin, ident in back]
