"""The paged snapshots under way, by session and by tenant, each bounded.

A paged snapshot under way (``kvstore.routing.SnapshotWalk``) holds a copy of the
shard of a namespace's key map that it is going through (up to 4096 entries of a
namespace that has not split its map, a 256th of a larger one's), and whatever blocks
that copy names, evicted since or not.  A session keeps at most ``per_session`` of
them (one more ends its oldest); that alone let a tenant keep 4 for each of its 4096
sessions: 2000 walks begun with a page of 3 entries over a namespace of 4096 blocks,
never finished, grew the daemon by 63 MiB.  A tenant now keeps at most ``per_tenant``
over all its sessions: one more ends the tenant's oldest (the least recently paged),
whichever of its sessions began it, and never another tenant's.  A walk ends with its
session, and the tenant's count with it.
"""

from __future__ import annotations

import weakref
from typing import Generic, Protocol, TypeVar


class _Tenanted(Protocol):
    @property
    def tenant(self) -> str: ...


S = TypeVar("S", bound=_Tenanted)
W = TypeVar("W")


class Walks(Generic[S, W]):
    """Walks by cursor (unique in the daemon), each of one session: ``take`` one to
    page it, ``keep`` it again (or a new one) while it has pages left."""

    def __init__(self, per_session: int, per_tenant: int) -> None:
        self.per_session = per_session
        self.per_tenant = per_tenant
        # a session's walks, oldest first (gone with the session)
        self._sessions: weakref.WeakKeyDictionary[S, dict[int, W]] = (
            weakref.WeakKeyDictionary())
        # a tenant's walks, by cursor, oldest first: the session's walks they are in
        self._tenants: dict[str, dict[int, dict[int, W]]] = {}

    def take(self, session: S, cursor: int) -> W | None:
        """The session's walk of ``cursor``, no longer kept; None if it has none."""
        walks = self._sessions.get(session)
        if walks is None or cursor not in walks:
            return None
        self._untrack(session.tenant, cursor)
        return walks.pop(cursor)

    def keep(self, session: S, cursor: int, walk: W) -> None:
        """Keep ``walk`` under ``cursor`` as the session's and its tenant's newest,
        ending their oldest past their bounds."""
        walks = self._sessions.get(session)
        tenant = session.tenant
        if walks is None:
            walks = self._sessions[session] = {}
            weakref.finalize(session, self._forget, tenant, walks)
        while len(walks) >= self.per_session:
            oldest = next(iter(walks))
            del walks[oldest]
            self._untrack(tenant, oldest)
        mine = self._tenants.setdefault(tenant, {})
        while len(mine) >= self.per_tenant:
            oldest = next(iter(mine))
            del mine.pop(oldest)[oldest]
        walks[cursor] = walk
        mine[cursor] = walks

    def count(self, tenant: str | None = None) -> int:
        """Walks kept: of ``tenant``, or of every tenant."""
        if tenant is not None:
            return len(self._tenants.get(tenant, ()))
        return sum(map(len, self._tenants.values()))

    def _untrack(self, tenant: str, cursor: int) -> None:
        mine = self._tenants.get(tenant)
        if mine is not None:
            mine.pop(cursor, None)
            if not mine:
                del self._tenants[tenant]

    def _forget(self, tenant: str, walks: dict[int, W]) -> None:
        """A session ended: its walks leave its tenant's count."""
        for cursor in walks:
            self._untrack(tenant, cursor)
        walks.clear()
