"""Closing a namespace: a session that uses many over its life (an engine's cache salts
or adapters, one namespace each) stops using those it is done with, so that they no
longer count against ``server.max_namespaces_per_session`` (1024 open at once).

Before, nothing closed one but the session's end: the 1025th salt an engine served was
refused its namespace for the rest of the engine's life, every request of it a miss
and none of it stored.  A close leaves the blocks where they are (another session, or
this one opening it again, finds them) and is refused while the session has a
reservation open in the namespace (a commit into a namespace the store forgot would have
nowhere to go); pins keep their blocks, and so the namespace, until released.

The namespaces of sessions that ended are closed here too, a slice a loop turn
(``kvstore.namespace_closes``), by turns with the daemon's other work in slices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from kvstore import protocol as p
from kvstore.errors import NamespaceInUseError, UnknownNamespaceError
from kvstore.sessions import Session, Sessions
from kvstore.store import BlockStore
from kvstore.verbs import Answer, Handler, Verbs


class _Daemon(Protocol):
    store: BlockStore
    sessions: Sessions
    verbs: Verbs

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class NamespaceVerbs:
    """The ``close`` verb, and the closes of sessions that ended."""

    def __init__(self, d: _Daemon) -> None:
        self.d = d
        closes = d.sessions.closes
        closes.wake = lambda: d.spawn(closes.run(d.verbs.removals.turns))

    def table(self) -> dict[type[Any], Handler]:
        return {p.CloseNamespace: self._close}

    def _close(self, session: Session, req: p.CloseNamespace, payload: list[Any]) -> Answer:
        store = self.d.store
        if req.ns not in session.namespaces:
            raise UnknownNamespaceError("namespace not opened in this session; open it first")
        ns = store.namespaces[req.ns]
        state = store.owners.get(session.id)
        open_here = 0 if state is None else sum(
            r.ns is ns for r in state.reservations.values())
        if open_here:
            raise NamespaceInUseError(
                f"the session has {open_here} {NamespaceInUseError.MARK}; commit or abort "
                f"them before closing it")
        session.namespaces.discard(req.ns)
        store.close_namespace(ns)  # (forgotten if nothing else keeps it: no block, no user)
        return p.OkReply(req.rid), []
