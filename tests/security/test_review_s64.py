"""A second reader of session 63's bounds, against a running daemon (session 64): big
replies unread counted per tenant, and whole snapshots counted until sent.  Real daemon
processes, raw ZeroMQ where a client library would not send what is sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq
from kvtest import make_identity
from test_attacks_s63 import Peer, fill
from test_attacks_s63b import Deaf, refusal
from test_attacks_s63c import _unread_bytes

from kvstore import Client
from kvstore import protocol as p


def _replies(peer: Deaf) -> list[p.Message]:
    """Every reply ``peer`` left unread, read now."""
    out = []
    while peer.sock.poll(500):
        out.append(p.reply_decoder.decode(peer.sock.recv_multipart()[0]))
    return out


def test_replies_after_a_goodbye_leave_no_connection_out_of_its_tenant_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A connection's unread bytes were charged to the tenant its session had when the
    first of them was counted, and to it only, until every one of them was sent.  A
    whole snapshot's reply goes out after its session may have ended: a connection that
    asked one and said goodbye at once had that reply (1.4 MB) charged to no tenant,
    and then, said hello again as the same tenant, left page after page unread charged
    to no tenant either: two such connections left 2.4 MiB unread against a 1 MiB
    tenant bound, charged to no tenant, and the tenant's next request was served.
    Each reply is now charged as it is handed to ZeroMQ, to the tenant of the
    connection then, or to the one that asked for it (a whole snapshot's)."""
    config = tmp_path / "kvstore.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "64MiB"\n'
                      'max_bytes_in_flight_per_tenant = "1MiB"\n')
    d = daemon_factory(dram_capacity="256MiB", debug_invariants=False,
                       extra=["--config", str(config)])
    fill(d.endpoint, "acme", 30_000)  # a whole snapshot more than the socket buffers take
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        deaf = [Deaf(ctx, d.endpoint, "acme") for _ in range(2)]
        for peer in deaf:
            peer.send(p.Snapshot(10, 0, 0))  # whole: built in a task, sent after the bye
            peer.send(p.Bye(11))
        time.sleep(1.0)
        for peer in deaf:
            peer.send(p.Hello(12, p.PROTOCOL_VERSION, "acme"))
            for rid in range(20):
                peer.send(p.Snapshot(100 + rid, 0, 4096))
        held = _unread_bytes(d)
        with Client(d.endpoint, tenant="acme") as c:  # over its bound: refused
            message = refusal(c._call(p.Snapshot(c._next_rid(), 0, 4096))[0])
            assert "max_bytes_in_flight_per_tenant" in message, (held, message)
        with Client(d.endpoint, tenant="globex") as c:  # another tenant: served
            reply = c._call(p.Snapshot(c._next_rid(), 0, 4096))[0]
            assert isinstance(reply, p.SnapshotReply), reply
        for peer in deaf:
            replies = _replies(peer)
            whole = [r for r in replies if isinstance(r, p.SnapshotReply) and r.rid == 10]
            assert len(whole) == 1 and len(whole[0].blocks) == 30_000
            pages = [r for r in replies if r.rid >= 100]
            refused = [r for r in pages if isinstance(r, p.ErrorReply)]
            assert len(pages) == 20 and refused, (
                f"{len(pages) - len(refused)} pages served unread, none refused, "
                f"{held / 2**20:.1f} MiB unread (tenant bound 1 MiB)")
            assert all("max_bytes_in_flight" in refusal(r) for r in refused)
            peer.close()
        assert _unread_bytes(d) == 0
        with Client(d.endpoint, tenant="acme") as c:  # read: served again
            reply = c._call(p.Snapshot(c._next_rid(), 0, 4096))[0]
            assert isinstance(reply, p.SnapshotReply), reply
    finally:
        ctx.destroy(linger=0)


def test_a_get_refused_for_the_work_under_way_leaves_no_pin(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A get over its session's bytes in flight, with replies of its own still being
    sent, waits for them in a task (``Later``), its blocks pinned (by the daemon's get
    owner, whose pins no lease ends).  Refused there for the work under way
    (``server.max_requests_under_way``, a session's 256, a tenant's share), its
    coroutine was closed before it ran and its pin was never let go: the blocks stayed
    pinned for the daemon's life, never evicted (16 of 16 kept here after every reply
    was read and the connection closed).  The pin now goes with the refusal."""
    config = tmp_path / "kvstore.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "256KiB"\n'
                      'max_requests_under_way = 4\n')
    d = daemon_factory(extra=["--config", str(config)])
    identity = make_identity(num_layers=4, head_dim=128)  # 64 KiB blocks
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(identity)
        keys = ns.keys(range(16 * 16))
        ns.put(keys, [b"\7" * ns.block_bytes] * len(keys))
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        peer = Deaf(ctx, d.endpoint, "acme")
        peer.send(p.OpenNamespace(10, identity))
        for rid in range(40):  # 1 MiB each, unread
            peer.send(p.Get(100 + rid, identity.namespace_id, keys))
        replies = _replies(peer)
        gets = [r for r in replies if r.rid >= 100]
        assert len(gets) == 40, len(gets)
        refused = [refusal(r) for r in gets if isinstance(r, p.ErrorReply)]
        assert any("under way" in message for message in refused), refused
        peer.close()
        time.sleep(0.5)
        with Client(d.endpoint, tenant="acme") as c:
            evicted = c.namespace(identity).evict(keys)
        assert evicted == len(keys), f"{len(keys) - evicted} of {len(keys)} blocks kept pinned"
    finally:
        ctx.destroy(linger=0)


def test_a_lookup_pin_refused_for_the_work_under_way_leaves_no_pin(
        daemon_factory: Any, fresh_redis_server: Any, tmp_path: Path) -> None:
    """A ``lookup_pin`` that asks the remote tier for the keys past its local hits pins
    those hits for its session, then waits in a task.  Refused there for the work under
    way, its coroutine was closed before it ran: the pin stayed the session's, unknown
    to its client (no reply carried it), and its blocks could not be evicted until the
    session ended.  The pin now goes with the refusal."""
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\nmax_requests_under_way = 4\n")
    d = daemon_factory(extra=["--config", str(config), "--remote", fresh_redis_server.url],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "20"})
    identity = make_identity()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(identity)
        keys = ns.keys(range(3 * 16))
        ns.put(keys[:2], [b"\5" * ns.block_bytes] * 2)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        peer = Peer(ctx, d.endpoint, "acme")
        assert isinstance(peer.ask(p.OpenNamespace(2, identity)), p.NamespaceReply)
        fresh_redis_server.pause()  # each remote lookup waits
        try:
            for rid in range(10):
                peer.send(p.LookupPin(100 + rid, identity.namespace_id, keys))
            refused = [refusal(r) for r in peer.replies(8, 10)]
            assert len(refused) == 8 and all("under way" in m for m in refused), refused
        finally:
            fresh_redis_server.resume()
        pinned = peer.replies(2, 30)
        assert len(pinned) == 2, pinned
        for reply in pinned:
            assert isinstance(reply, p.LookupPinReply) and reply.pin, reply
            assert isinstance(peer.ask(p.Release(200 + reply.rid, reply.pin)), p.OkReply)
        evicted = peer.ask(p.Evict(300, identity.namespace_id, keys[:2]))
        assert isinstance(evicted, p.CountReply) and evicted.count == 2, (
            f"{evicted}: the blocks were still pinned by the refused lookups")
    finally:
        ctx.destroy(linger=0)
