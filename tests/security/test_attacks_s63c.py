"""A hostile tenant against a running daemon (session 63, third part): many sessions of
one tenant, each within its connection's bounds, that together held far more.  Real
daemon processes, raw ZeroMQ where a client library would not send what is sent."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import zmq
from kvtest import make_identity
from test_attacks_s63b import Deaf, refusal

from kvstore import Client
from kvstore import protocol as p




def tiny(tenant: str = "acme") -> Any:
    return make_identity(num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1,
                         tenant=tenant)


def _daemon(daemon_factory: Any, tmp_path: Path, toml: str,
            tenants: tuple[str, ...] = ("acme",)) -> Any:
    """A daemon configured with ``toml`` whose tenants (acme) each hold 8192 blocks of
    4 bytes (a snapshot page of them is a few hundred KiB)."""
    config = tmp_path / "kvstore.toml"
    config.write_text(toml)
    d = daemon_factory(extra=["--config", str(config)])
    for tenant in tenants:
        with Client(d.endpoint, tenant=tenant) as client:
            ns = client.namespace(tiny(tenant))
            for _ in range(128):
                ns.put([os.urandom(16) for _ in range(64)], [b"abcd"] * 64)
    return d


def _unread_bytes(d: Any) -> int:
    """The daemon's bytes of big replies unread, once they stop growing."""
    last = -1
    while True:
        with Client(d.endpoint, tenant="audit") as c:
            now = int(c.stats()["replies"]["unread_bytes"])
        if now == last:
            return now
        last = now
        time.sleep(0.5)


def _leave_pages_unread(ctx: zmq.Context[Any], d: Any, sessions: int,
                        tenant: str = "acme") -> list[Deaf]:
    deaf = [Deaf(ctx, d.endpoint, tenant) for _ in range(sessions)]
    for i, peer in enumerate(deaf):
        for rid in range(20):
            peer.send(p.Snapshot(1000 * i + 100 + rid, 0, 8192))
    time.sleep(1.0)
    return deaf


def _read_and_close(deaf: list[Deaf]) -> None:
    for peer in deaf:
        while peer.sock.poll(300):
            peer.sock.recv_multipart()
        peer.close()


def test_big_replies_unread_are_bounded_per_tenant_over_its_sessions(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Each connection may leave ``max_bytes_in_flight`` of big replies (snapshot pages,
    ...) unread, but nothing summed them over a tenant's sessions (4096 of them): 12
    sessions of one tenant, each leaving pages unread, made the daemon hold 7.6 MiB
    against a 1 MiB connection bound and a 2 MiB tenant bound (which counted only gets'
    and puts' bytes).  Now a tenant's unread bytes count against its bound: past it, its
    requests are refused with a typed error that says to read, other tenants are served,
    and the count goes back once the replies are read."""
    d = _daemon(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "1MiB"\n'
                'max_bytes_in_flight_per_tenant = "2MiB"\n')
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        deaf = _leave_pages_unread(ctx, d, 12)
        held = _unread_bytes(d)
        assert held < 3 << 20, (f"12 sessions of one tenant left {held / 2**20:.1f} MiB of "
                                f"replies unread in the daemon (tenant bound 2 MiB)")
        with Client(d.endpoint, tenant="acme") as c:
            message = refusal(c._call(p.Snapshot(c._next_rid(), 0, 8192))[0])
            assert "max_bytes_in_flight_per_tenant" in message and "read" in message
        with Client(d.endpoint, tenant="globex") as c:  # another tenant: served
            reply = c._call(p.Snapshot(c._next_rid(), 0, 8192))[0]
            assert isinstance(reply, p.SnapshotReply), reply
        _read_and_close(deaf)
        assert _unread_bytes(d) == 0
        with Client(d.endpoint, tenant="acme") as c:  # read: served again
            reply = c._call(p.Snapshot(c._next_rid(), 0, 8192))[0]
            assert isinstance(reply, p.SnapshotReply), reply
    finally:
        ctx.destroy(linger=0)


def test_big_replies_unread_are_bounded_over_the_daemon(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The same over every tenant (``max_bytes_in_flight_total``): with no tenant bound,
    12 sessions of one tenant hold as much; now at most the daemon's bound (3 MiB here)
    and a reply, and a tenant with nothing unread is still served."""
    d = _daemon(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "1MiB"\n'
                'max_bytes_in_flight_per_tenant = 0\nmax_bytes_in_flight_total = "3MiB"\n')
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        deaf = _leave_pages_unread(ctx, d, 12)
        held = _unread_bytes(d)
        assert held < 4 << 20, f"{held / 2**20:.1f} MiB unread (daemon bound 3 MiB)"
        with Client(d.endpoint, tenant="acme") as c:
            message = refusal(c._call(p.Snapshot(c._next_rid(), 0, 8192))[0])
            assert "max_bytes_in_flight_total" in message, message
        with Client(d.endpoint, tenant="globex") as c:
            reply = c._call(p.Snapshot(c._next_rid(), 0, 8192))[0]
            assert isinstance(reply, p.SnapshotReply), reply
        _read_and_close(deaf)
        assert _unread_bytes(d) == 0
    finally:
        ctx.destroy(linger=0)


def test_tenants_that_read_are_served_while_others_hold_the_daemons_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The daemon's bound refuses the tenants that leave replies unread, not the others:
    two tenants, each leaving its own bound's worth unread (2 MiB each against a daemon
    bound of 4 MiB), got every other tenant's get refused, told to "read the replies
    first" though it had none unread.  Now that tenant's gets and puts go on, and the
    two are refused at their share of the bound."""
    d = _daemon(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "1MiB"\n'
                'max_bytes_in_flight_per_tenant = "2MiB"\n'
                'max_bytes_in_flight_total = "4MiB"\n', tenants=("acme", "initech"))
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        deaf = [*_leave_pages_unread(ctx, d, 12, "acme"),
                *_leave_pages_unread(ctx, d, 12, "initech")]
        held = _unread_bytes(d)
        assert held >= 4 << 20, f"only {held / 2**20:.1f} MiB unread: the bound not reached"
        with Client(d.endpoint, tenant="globex") as c:
            ns = c.namespace(tiny("globex"))
            keys = [os.urandom(16) for _ in range(8)]
            ns.put(keys, [b"wxyz"] * 8)
            assert ns.get(keys) == [b"wxyz"] * 8  # before: refused, limit_exceeded
        for tenant in ("acme", "initech"):
            with Client(d.endpoint, tenant=tenant) as c:
                message = refusal(c._call(p.Snapshot(c._next_rid(), 0, 8192))[0])
                assert "max_bytes_in_flight" in message and "read" in message, message
        _read_and_close(deaf)
        assert _unread_bytes(d) == 0
    finally:
        ctx.destroy(linger=0)
