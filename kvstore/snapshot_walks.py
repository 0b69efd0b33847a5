"""The paged snapshots under way, by session and by tenant, each bounded.

A paged snapshot under way (``kvstore.routing.SnapshotWalk``) holds a copy of the
shard of a namespace's key map that it is going through (up to 4096 entries of a
namespace that has not split its map, a 256th of a larger one's), and whatever blocks
that copy names, evicted since or not.  A session keeps at most ``per_session`` of
them (one more ends its oldest); that alone let a tenant keep 4 for each of its 4096
sessions: 2000 walks begun with a page of 3 entries over a namespace of 4096 blocks,
never finished, grew the daemon by 63 MiB.  A tenant now keeps at most ``per_tenant``
over all its sessions: one more ends the tenant's oldest (the least recently paged),
whichever of its sessions began it, and never another tenant's.  And the daemon keeps
at most ``per_daemon`` (tenant names cost nothing without credentials, and each name
may keep ``per_tenant``): one more ends the oldest of the tenant keeping the most.  A
walk ends with its session, and the tenant's count with it.
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

    def __init__(self, per_session: int, per_tenant: int, per_daemon: int = 0) -> None:
        self.per_session = per_session
        self.per_tenant = per_tenant
        self.per_daemon = per_daemon  # (0: no bound but the tenants')
        self._kept = 0  # walks kept, of every tenant
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
            self._end_oldest(tenant, mine)
        while self.per_daemon and self._kept >= self.per_daemon:
            # the daemon's bound: the oldest walk of the tenant keeping the most ends
            # (tenant names cost nothing without credentials: each may keep per_tenant)
            self._end_oldest(*max(self._tenants.items(), key=lambda item: len(item[1])))
        walks[cursor] = walk
        mine[cursor] = walks
        self._tenants[tenant] = mine  # (again, if the daemon's bound ended its last)
        self._kept += 1

    def _end_oldest(self, tenant: str, mine: dict[int, dict[int, W]]) -> None:
        oldest = next(iter(mine))
        del mine.pop(oldest)[oldest]
        self._kept -= 1
        if not mine:
            del self._tenants[tenant]

    def count(self, tenant: str | None = None) -> int:
        """Walks kept: of ``tenant``, or of every tenant."""
        if tenant is not None:
            return len(self._tenants.get(tenant, ()))
        return self._kept

    def _untrack(self, tenant: str, cursor: int) -> None:
        mine = self._tenants.get(tenant)
        if mine is not None:
            if mine.pop(cursor, None) is not None:
                self._kept -= 1
            if not mine:
                del self._tenants[tenant]

    def _forget(self, tenant: str, walks: dict[int, W]) -> None:
        """A session ended: its walks leave its tenant's count."""
        for cursor in walks:
            self._untrack(tenant, cursor)
        walks.clear()
