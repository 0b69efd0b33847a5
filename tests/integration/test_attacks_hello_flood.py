"""A peer of one tenant that says hello on connection after connection, and goes: each
session stays till its lease ends (about 1.6 KB each; at a few thousand hellos a second
and a 30 s lease, some 100 MB).  ``max_sessions_per_tenant`` bounds what a tenant holds
so: past it a hello is refused and opens nothing, and a session that ended makes room."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.config import ServerConfig
from kvstore.errors import LimitExceededError
from kvstore.sessions import Session, Sessions
from kvstore.store import BlockStore, Limits

LEASE = 5.0
CAP = 8


def test_hellos_past_a_tenants_session_cap_are_refused_and_open_nothing() -> None:
    now = [0.0]
    slot = make_identity().block_bytes
    store = BlockStore(64 * slot, 16 * slot, limits=Limits(lease_seconds=LEASE))
    sessions = Sessions(store, ServerConfig(), clock=lambda: now[0],
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    sessions.max_sessions_per_tenant = CAP
    first = [sessions.hello(b"c%d" % i, "acme", "") for i in range(CAP)]
    for i in range(CAP, 3 * CAP):
        with pytest.raises(LimitExceededError, match="sessions"):
            sessions.hello(b"c%d" % i, "acme", "")
    assert len(sessions) == CAP and len(store.owners) == CAP
    assert len(sessions.by_connection) == CAP
    sessions.hello(b"second-socket", "acme", first[0].id)  # attaching opens none
    sessions.hello(b"other", "globex", "")  # another tenant's cap is its own
    now[0] = LEASE / 2
    for session in first[1:]:
        store.touch_owner(session.id, now[0])
    now[0] = LEASE + 0.1
    sessions.forget(set(store.expire(now[0])))  # the first one's lease ran out
    sessions.hello(b"again", "acme", "")        # room for one
    with pytest.raises(LimitExceededError):
        sessions.hello(b"again-2", "acme", "")
    sessions.check_invariants()


class _Walked(dict[str, Session]):
    """The sessions by id, counting those walked over (a deterministic measure of work)."""

    walked = 0

    def values(self) -> Any:
        _Walked.walked += len(self)
        return super().values()


def test_a_writer_grantees_reserve_does_not_walk_other_tenants_sessions() -> None:
    slot = make_identity().block_bytes
    store = BlockStore(64 * slot, 16 * slot, limits=Limits(lease_seconds=LEASE))
    sessions = Sessions(store, ServerConfig(), clock=lambda: 0.0, grantee_pin_share=0.5,
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    for i in range(1000):  # another tenant's flood of hellos
        sessions.hello(b"flood%d" % i, "mallory", "")
    writer = sessions.hello(b"writer", "acme", "")
    shared = store.open_namespace(make_identity(tenant="public"))
    sessions.by_id = _Walked(sessions.by_id)
    sessions.check_grant_reserve(writer, shared, 1)  # (a shared_writers grantee's reserve)
    assert _Walked.walked == 0
    sessions.check_invariants()


def test_the_daemon_refuses_a_hello_past_its_configured_cap_and_serves_the_rest(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Through a real daemon: the setting from its configuration, a hello past it refused
    with a typed error, the sessions it holds still served, and room again once a closed
    one's lease has ended."""
    config = tmp_path / "cap.toml"
    config.write_text("[server]\nmax_sessions_per_tenant = 3\n")
    d = daemon_factory(lease=1.0, extra=["--config", str(config)])
    held = [Client(d.endpoint, tenant="acme") for _ in range(3)]
    try:
        for client in held:
            client.ping()
        with pytest.raises(LimitExceededError, match="sessions"):
            Client(d.endpoint, tenant="acme").ping()
        assert held[0].stats()["sessions"] == 3  # the refused hello opened none
        other = Client(d.endpoint, tenant="globex")  # another tenant's cap is its own
        other.ping()
        other.close()
        held.pop().close()  # its session ends with its lease: room for one more
        deadline = time.monotonic() + 10
        while held[0].stats()["sessions"] > 2:
            assert time.monotonic() < deadline, "the closed sessions never ended"
            held[1].ping()  # (the others' leases renewed)
            time.sleep(0.05)
        again = Client(d.endpoint, tenant="acme")
        again.ping()
        held.append(again)
    finally:
        for client in held:
            client.close()
    assert d.alive(), d.log()
