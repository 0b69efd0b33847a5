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
