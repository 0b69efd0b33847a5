"""A peer that says hello under name after name (a daemon without credentials takes the
tenant a client names): once their sessions end, nothing of those tenants stays, and no
limit of a tenant is lifted by forgetting it."""

from __future__ import annotations

import pytest

from kvtest import make_identity

from kvstore.config import ServerConfig
from kvstore.errors import ForbiddenError, LimitExceededError
from kvstore.sessions import Sessions
from kvstore.store import BlockStore, Limits

LEASE = 5.0


def _sessions(now: list[float], **caps: int) -> tuple[BlockStore, Sessions]:
    slot = make_identity().block_bytes
    store = BlockStore(64 * slot, 16 * slot, limits=Limits(lease_seconds=LEASE))
    sessions = Sessions(store, ServerConfig(**caps), clock=lambda: now[0],
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    return store, sessions


def _reap(store: BlockStore, sessions: Sessions, now: float) -> None:
    """What the daemon's reaper does each period."""
    sessions.forget(set(store.expire(now)))
    sessions.drop_idle_tenants()


@pytest.mark.parametrize("rate", [0, 50])
def test_tenants_of_sessions_that_ended_are_forgotten(rate: int) -> None:
    now = [0.0]
    store, sessions = _sessions(now, max_requests_per_second_per_tenant=rate)
    for i in range(200):
        sessions.hello(b"c%d" % i, f"tenant-{i}", "")
    kept = sessions.hello(b"kept", "kept", "")
    assert len(sessions.tenants) == 201
    now[0] = LEASE / 2
    store.touch_owner(kept.id, now[0])  # a request of its
    now[0] = LEASE + 1
    _reap(store, sessions, now[0])
    assert list(sessions.tenants) == ["kept"]
    sessions.check_invariants()


def test_tenants_of_refused_hellos_are_forgotten_once_their_rate_bucket_is_full() -> None:
    now = [0.0]
    store, sessions = _sessions(now, max_requests_per_second_per_tenant=2)
    for i in range(2):
        with pytest.raises(ForbiddenError):
            sessions.hello(b"c%d" % i, "bogus", "no-such-session")
    # its bucket is empty: forgetting it now would hand the next hello a full one
    _reap(store, sessions, now[0])
    assert "bogus" in sessions.tenants
    with pytest.raises(LimitExceededError):
        sessions.hello(b"c2", "bogus", "")
    now[0] = 1.0
    _reap(store, sessions, now[0])
    assert not sessions.tenants
    sessions.hello(b"c3", "bogus", "")  # made anew, as it would have been refilled
    sessions.hello(b"c4", "bogus", "")
    with pytest.raises(LimitExceededError):
        sessions.hello(b"c5", "bogus", "")
    sessions.check_invariants()
