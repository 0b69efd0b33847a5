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
