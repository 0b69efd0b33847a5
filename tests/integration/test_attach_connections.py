"""Connections attached to one session: a client's sockets, or a peer that reconnects
and attaches again and again.  A session keeps its latest ``CONNECTIONS_PER_SESSION``
(each attach held ~140 bytes for the session's life, and every lease's end walked all
of them on the loop: a million attaches, 81 MB and 350 ms); the oldest is let go and is
a peer without a session again."""

from __future__ import annotations

from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_protocol_abuse import Raw, error_code

from kvstore import protocol as p
from kvstore.config import ServerConfig
from kvstore.sessions import CONNECTIONS_PER_SESSION, Sessions
from kvstore.store import BlockStore, Limits


def test_a_session_keeps_its_latest_connections(daemon: DaemonProcess) -> None:
    first = Raw(daemon.endpoint)
    others: list[Raw] = []
    try:
        hello = first.ask(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme")))
        assert isinstance(hello, p.HelloReply)
        for _ in range(CONNECTIONS_PER_SESSION):  # one more than it keeps, with the first
            raw = Raw(daemon.endpoint)
            others.append(raw)
            again = raw.ask(p.encoder.encode(
                p.Hello(1, p.PROTOCOL_VERSION, "acme", attach=hello.session)))
            assert isinstance(again, p.HelloReply) and again.session == hello.session
        # the oldest was let go, and is told so
        gone = first.ask(p.encoder.encode(p.Ping(2)))
        assert error_code(gone) == "forbidden" and "newer connections" in gone.message, gone
        for raw in (others[0], others[-1]):  # the others still are the session's
            assert isinstance(raw.ask(p.encoder.encode(p.Ping(3))), p.OkReply)
    finally:
        for raw in (first, *others):
            raw.close()


def test_a_lease_end_walks_only_its_sessions_connections() -> None:
    now = [0.0]
    slot = make_identity().block_bytes
    store = BlockStore(64 * slot, 16 * slot, limits=Limits(lease_seconds=30))
    sessions = Sessions(store, ServerConfig(), clock=lambda: now[0],
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    keep = sessions.hello(b"\0keep", "acme", "")
    other = sessions.hello(b"\0other", "globex", "")
    for i in range(10 * CONNECTIONS_PER_SESSION):
        sessions.hello(b"\1" + i.to_bytes(4, "big"), "acme", keep.id)
    assert len(keep.connections) == CONNECTIONS_PER_SESSION  # the latest, in order
    latest = b"\1" + (10 * CONNECTIONS_PER_SESSION - 1).to_bytes(4, "big")
    assert list(keep.connections)[-1] == latest
    assert len(sessions.by_connection) == CONNECTIONS_PER_SESSION + 1
    assert b"\0keep" not in sessions.by_connection and sessions.known(b"\0keep")  # told
    sessions.forget({other.id})
    assert b"\0other" not in sessions.by_connection and sessions.known(b"\0other")
    assert len(sessions.by_connection) == CONNECTIONS_PER_SESSION
    sessions.forget({keep.id})
    assert not sessions.by_connection
    assert all(sessions.known(rid) for rid in keep.connections)  # told it expired


def test_a_goodbye_leaves_an_attached_session_and_the_last_one_ends_it(
        daemon: DaemonProcess) -> None:
    """A connection's goodbye takes it out of a session others are attached to (which
    keeps its holdings for them); the last connection's goodbye ends the session and
    gives back its pins then, not at its lease's end (every goodbye was a no-op while
    another connection had ever attached, so the session's pins stayed a lease long)."""
    ident = make_identity()
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    first, second, watcher = Raw(daemon.endpoint), Raw(daemon.endpoint), Raw(daemon.endpoint)
    try:
        hello = first.ask(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme")))
        assert isinstance(hello, p.HelloReply)
        again = second.ask(p.encoder.encode(
            p.Hello(1, p.PROTOCOL_VERSION, "acme", attach=hello.session)))
        assert isinstance(again, p.HelloReply) and again.session == hello.session
        assert isinstance(watcher.ask(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme"))),
                          p.HelloReply)
        opened = first.ask(p.encoder.encode(p.OpenNamespace(2, ident)))
        assert isinstance(opened, p.NamespaceReply)
        ns = ident.namespace_id
        put = first.ask(p.encoder.encode(p.Put(3, ns, keys)),
                        *(b"\7" * ident.block_bytes for _ in keys))
        assert isinstance(put, p.PutReply), put
        held = second.ask(p.encoder.encode(p.Acquire(4, ns, keys)))
        assert isinstance(held, p.AcquireReply) and len(held.offsets) == 2, held

        def pinned() -> int:
            stats = watcher.ask(p.encoder.encode(p.Stats(9)))
            assert isinstance(stats, p.StatsReply)
            return int(stats.stats["tiers"]["dram"]["pinned_blocks"])

        assert isinstance(first.ask(p.encoder.encode(p.Bye(5))), p.OkReply)
        assert error_code(first.ask(p.encoder.encode(p.Ping(6)))) == "forbidden"
        assert isinstance(second.ask(p.encoder.encode(p.Ping(6))), p.OkReply)
        assert pinned() == 2  # the session goes on, for the connection left
        assert isinstance(second.ask(p.encoder.encode(p.Bye(7))), p.OkReply)
        assert pinned() == 0  # the last goodbye ended it
        assert isinstance(second.ask(p.encoder.encode(p.Ping(8))), p.ErrorReply)
    finally:
        for raw in (first, second, watcher):
            raw.close()
