"""The paged snapshots under way: bounded by session and by tenant, gone with their
session (``kvstore.snapshot_walks``)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from kvstore.snapshot_walks import Walks


@dataclass(eq=False)
class FakeSession:
    tenant: str


def test_a_tenant_keeps_its_newest_walks_over_all_its_sessions() -> None:
    walks: Walks[FakeSession, str] = Walks(per_session=2, per_tenant=3)
    a, b, other = FakeSession("acme"), FakeSession("acme"), FakeSession("globex")
    walks.keep(other, 100, "g")
    for cursor, session in ((1, a), (2, b), (3, a), (4, b)):
        walks.keep(session, cursor, str(cursor))
    assert walks.count("acme") == 3 and walks.count("globex") == 1
    assert walks.take(a, 1) is None  # the tenant's oldest, ended
    assert walks.take(b, 3) is None  # another session's cursor: not its walk
    assert walks.take(a, 3) == "3" and walks.count("acme") == 2
    walks.keep(a, 3, "3")  # paged: the tenant's newest again (2, 4, 3)
    walks.keep(a, 5, "5")  # the tenant's fourth: its oldest (2, of b) ends
    assert walks.take(b, 2) is None and walks.count("acme") == 3
    walks.keep(a, 6, "6")  # the session's third: its oldest (3) ends, 4 of b stays
    assert walks.take(a, 3) is None and walks.take(b, 4) == "4"
    assert walks.take(a, 5) == "5" and walks.take(a, 6) == "6"
    assert walks.take(other, 100) == "g" and walks.count("globex") == 0


def test_a_sessions_walks_leave_its_tenants_count_with_it() -> None:
    walks: Walks[FakeSession, str] = Walks(per_session=4, per_tenant=4)
    gone, stays = FakeSession("acme"), FakeSession("acme")
    walks.keep(gone, 1, "1")
    walks.keep(gone, 2, "2")
    walks.keep(stays, 3, "3")
    del gone
    gc.collect()
    assert walks.count("acme") == 1 and walks.count() == 1
    for cursor in range(4, 8):
        walks.keep(stays, cursor, str(cursor))
    assert walks.count("acme") == 4 and walks.take(stays, 7) == "7"


def test_the_daemons_bound_ends_the_busiest_tenants_oldest() -> None:
    """Tenant names cost nothing without credentials: past the daemon's bound the
    tenant keeping the most loses its oldest, the others keep theirs."""
    walks: Walks[FakeSession, str] = Walks(per_session=4, per_tenant=4, per_daemon=5)
    names = [FakeSession(f"t{i}") for i in range(3)]
    busy = FakeSession("busy")
    for cursor in range(1, 4):
        walks.keep(busy, cursor, str(cursor))
    walks.keep(names[0], 10, "a")
    walks.keep(names[1], 11, "b")
    assert walks.count() == 5
    walks.keep(names[2], 12, "c")  # the sixth: busy's oldest (1) ends
    assert walks.count() == 5 and walks.count("busy") == 2
    assert walks.take(busy, 1) is None and walks.take(names[0], 10) == "a"
    assert walks.count() == 4
    for cursor in range(20, 30):  # one tenant alone: its own oldest end, never past 5
        walks.keep(names[1], cursor, str(cursor))
        assert walks.count() <= 5
    assert walks.take(names[2], 12) == "c" and walks.take(busy, 3) == "3"
