"""The namespaces of sessions that ended, closed in slices (``kvstore.namespace_closes``):
the counts stay exact at every step."""

from __future__ import annotations

import asyncio
import weakref

import pytest
from kvtest import make_identity

from kvstore.config import ServerConfig
from kvstore.errors import LimitExceededError
from kvstore.keys import chain_keys
from kvstore.namespace_closes import CLOSE_SLICE, NamespaceCloses
from kvstore.sessions import Sessions
from kvstore.slice_turns import SliceTurns
from kvstore.plans import Plan
from kvstore.store import BlockStore

MANY = 3 * CLOSE_SLICE // 2


def _sessions() -> Sessions:
    slot = make_identity().block_bytes
    store = BlockStore(64 * slot, 16 * slot)
    sessions = Sessions(store, ServerConfig(), clock=lambda: 0.0,
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    sessions.max_namespaces_per_session = MANY + 1
    return sessions


def test_a_sessions_end_queues_its_closes_and_slices_close_them_exactly() -> None:
    """A session's end took every close in one loop turn; now it hands them over whole
    and each step closes at most ``CLOSE_SLICE``: the namespaces stay the store's, each
    with its user, till their close, and the invariant check holds at every step."""
    sessions = _sessions()
    store = sessions.store
    ended = sessions.hello(b"a", "acme", "")
    for i in range(MANY):
        sessions.open_namespace(ended, make_identity(salt=f"{i}"))
    sessions.forget({ended.id})
    assert len(store.namespaces) == MANY and len(sessions.closes) == MANY
    sessions.check_invariants()
    assert not sessions.closes.step(seconds=float("inf"))  # (the count bounds it)
    assert len(store.namespaces) == MANY - CLOSE_SLICE == len(sessions.closes)
    sessions.check_invariants()
    assert sessions.closes.step(seconds=float("inf")) and not store.namespaces and not sessions.closes
    assert not sessions.closes.by_tenant and not store.tenant_namespaces
    sessions.check_invariants()


def test_a_namespace_opened_again_while_its_close_is_queued_stays_with_its_blocks() -> None:
    sessions = _sessions()
    store = sessions.store
    ended = sessions.hello(b"a", "acme", "")
    full = sessions.open_namespace(ended, make_identity(salt="full"))
    empty = sessions.open_namespace(ended, make_identity(salt="empty"))
    keys = chain_keys(full.id, list(range(16)), 16)
    r = store.reserve(ended.id, full, keys, None, 0.0)
    assert not isinstance(r, Plan)
    store.commit(ended.id, r.id, 0.0)
    sessions.counted(ended)
    store.drop_owner(ended.id)
    sessions.forget({ended.id})
    other = sessions.hello(b"b", "acme", "")
    assert sessions.open_namespace(other, make_identity(salt="full")) is full
    assert sessions.open_namespace(other, make_identity(salt="empty")) is empty
    sessions.check_invariants()
    sessions.closes.finish()
    assert (full.users, empty.users) == (1, 1) and len(full.blocks) == 1
    assert store.namespaces == {full.id: full, empty.id: empty}
    sessions.check_invariants()
    sessions.forget({other.id})
    sessions.closes.finish()
    assert store.namespaces == {full.id: full} and not full.users  # (its block keeps it)
    sessions.check_invariants()


def test_a_tenant_at_its_namespace_cap_is_told_its_closes_are_under_way() -> None:
    """Queued closes count to the tenant's cap (the namespaces are still the store's);
    the refusal says they are being closed, and once they are, the tenant opens more."""
    sessions = _sessions()
    sessions.max_namespaces_per_tenant = MANY
    ended = sessions.hello(b"a", "acme", "")
    for i in range(MANY):
        sessions.open_namespace(ended, make_identity(salt=f"{i}"))
    sessions.forget({ended.id})
    again = sessions.hello(b"b", "acme", "")
    with pytest.raises(LimitExceededError, match="being closed now"):
        sessions.open_namespace(again, make_identity(salt="new"))
    sessions.open_namespace(again, make_identity(salt="0"))  # one it still has: open
    sessions.closes.finish()
    sessions.open_namespace(again, make_identity(salt="new"))
    sessions.check_invariants()


def test_the_namespaces_of_sessions_that_ended_are_let_go_at_once() -> None:
    """The store's namespace order (``kvstore.namespace_order``) held every namespace
    forgotten until the next one was made: 50 sessions of 1000 namespaces that ended
    left all of them (and most of the memory they took) with the daemon.  Now it holds
    them weakly and lets go of the references as they are forgotten."""
    sessions = _sessions()
    store = sessions.store
    ended = sessions.hello(b"a", "acme", "")
    first = weakref.ref(sessions.open_namespace(ended, make_identity(salt="first")))
    for i in range(MANY):
        sessions.open_namespace(ended, make_identity(salt=f"{i}"))
    sessions.forget({ended.id})
    sessions.closes.finish()
    assert first() is None, "a namespace forgotten is still held"
    assert len(store.order.spaces) <= 64, store.order
    assert store.order.after(0) == (store.order.last, None)


def test_a_run_that_failed_is_started_again_by_the_next_close_queued() -> None:
    """The daemon drains the queue with a task it starts when closes are queued and no
    drain is under way: one that ended by an error (or was cancelled) left closes queued
    behind it, and only an empty queue started another, so none ever did again."""
    class Failing:
        namespaces: dict[bytes, object] = {}

        def close_namespace(self, ns: object) -> None:
            raise RuntimeError("a close failed")

    closes = NamespaceCloses(Failing())  # type: ignore[arg-type]
    Failing.namespaces[b"a"] = object()
    started: list[int] = []
    closes.wake = lambda: started.append(1)
    closes.queue("acme", {b"a"})
    assert started == [1]

    async def drain() -> None:
        try:
            await closes.run(SliceTurns())
        except RuntimeError:
            pass

    asyncio.run(drain())
    assert not closes.running
    closes.queue("acme", {b"b"})
    assert started == [1, 1]  # before: [1], never started again


def test_a_grantees_session_queues_the_close_of_another_tenants_namespace() -> None:
    """A session may have another tenant's namespace open (a grant): its end queues
    that close under the session's tenant, and the invariant check holds (it asserted
    the namespace was the session tenant's, and failed every grantee's session end)."""
    sessions = _sessions()
    store = sessions.store
    grantee = sessions.hello(b"g", "guest", "")
    theirs = sessions.open_namespace(grantee, make_identity(tenant="acme", salt="shared"))
    own = sessions.open_namespace(grantee, make_identity(tenant="guest", salt="own"))
    sessions.forget({grantee.id})
    assert sessions.closes.by_tenant == {"guest": 2}
    sessions.check_invariants()
    sessions.closes.finish()
    assert theirs.id not in store.namespaces and own.id not in store.namespaces
    assert not sessions.closes.by_tenant and not store.tenant_namespaces
    sessions.check_invariants()
