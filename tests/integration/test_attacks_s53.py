"""A hostile tenant against a daemon with credentials (a token secret, a tcp endpoint):
what a raw peer sends past the protocol's rules is answered with a typed error, never
with silence, and leaves nothing held.  Real daemon processes, raw ZeroMQ sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_protocol_abuse import error_code
from test_tenant_isolation import Raw, cli

from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.transport import PRE_HELLO_MESSAGES


@pytest.fixture
def secured(daemon_factory: Any, tmp_path: Path) -> tuple[DaemonProcess, bytes]:
    """A daemon that takes tokens on its tcp endpoint."""
    secret = tmp_path / "secret"
    cli("keygen", "--secret", str(secret))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\noperators = ["ops"]\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config), "--slab-size", "1MiB"])
    return d, read_secret(secret)


def connect(d: DaemonProcess, secret: bytes, tenant: str, attach: str = "") -> tuple[Raw, str]:
    assert d.tcp_endpoint is not None
    raw = Raw(d.tcp_endpoint, tenant, token_of(secret, tenant))
    hello = raw.ask(p.Hello(1, p.PROTOCOL_VERSION, tenant, token_of(secret, tenant), attach))
    assert isinstance(hello, p.HelloReply), hello
    return raw, hello.session


def token_of(secret: bytes, tenant: str) -> str:
    return issue_token(secret, tenant, 3600.0)


def ask_frames(raw: Raw, msg: p.Message, *payload: bytes) -> p.Message:
    raw.sock.send_multipart([p.encoder.encode(msg), *payload])
    assert raw.sock.poll(10_000), f"the daemon did not answer a {type(msg).__name__}"
    return p.reply_decoder.decode(raw.sock.recv_multipart()[0])


def test_a_connection_that_left_its_session_is_answered_every_time(
        secured: tuple[DaemonProcess, bytes]) -> None:
    """A connection's goodbye, while another connection of its session stays, made it a
    peer without a session, as a stranger: a put it sent next (payload frames) and any
    request past its first few went unanswered, its client waiting out its timeout.
    Now each is told it said goodbye, and nothing it sends is taken."""
    d, secret = secured
    first, session = connect(d, secret, "acme")
    second, _ = connect(d, secret, "acme", attach=session)
    ops, _ = connect(d, secret, "ops")
    try:
        ident = make_identity(tenant="acme")
        opened = first.ask(p.OpenNamespace(2, ident))
        assert isinstance(opened, p.NamespaceReply)
        assert isinstance(second.ask(p.Bye(3)), p.OkReply)
        key = b"\5" * 16
        put = ask_frames(second, p.Put(4, opened.ns, [key]), b"\5" * opened.block_bytes)
        assert error_code(put) == "forbidden" and "goodbye" in put.message, put
        assert put.rid == 4
        for rid in range(5, 5 + 2 * PRE_HELLO_MESSAGES):  # past what a stranger gets
            reply = second.ask(p.Lookup(rid, opened.ns, [key]))
            assert error_code(reply) == "forbidden" and reply.rid == rid, reply
        # the session goes on for the other connection; the put took nothing
        looked = first.ask(p.Lookup(40, opened.ns, [key]))
        assert isinstance(looked, p.LookupReply) and looked.blocks == 0, looked
        # a hello on the connection that left opens a new session
        again = second.ask(p.Hello(41, p.PROTOCOL_VERSION, "acme", token_of(secret, "acme")))
        assert isinstance(again, p.HelloReply) and again.session != session
        assert isinstance(second.ask(p.Ping(42)), p.OkReply)
        stats = ops.ask(p.Stats(43))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["tiers"]["dram"]["reserved_slots"] == 0
        assert stats.stats["invariant_violations"] == 0
    finally:
        for raw in (first, second, ops):
            raw.close()


def test_ids_handed_to_one_tenant_tell_nothing_of_the_others_requests(
        secured: tuple[DaemonProcess, bytes]) -> None:
    """Reservation, pin and snapshot cursor ids came from daemon-wide counters: a tenant
    that reserved twice read, in the difference, how many reservations and pins every
    other tenant had taken meanwhile (figures its stats leave out with credentials).
    Now they are unique and unordered: the difference says nothing."""
    d, secret = secured
    spy, _ = connect(d, secret, "acme")
    other, _ = connect(d, secret, "globex")
    try:
        mine = spy.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
        theirs = other.ask(p.OpenNamespace(2, make_identity(tenant="globex")))
        assert isinstance(mine, p.NamespaceReply) and isinstance(theirs, p.NamespaceReply)

        def reserve(raw: Raw, ns: bytes, rid: int) -> int:
            reply = raw.ask(p.Reserve(rid, ns, [rid.to_bytes(16, "big")]))
            assert isinstance(reply, p.ReserveReply), reply
            assert isinstance(raw.ask(p.Abort(rid + 1, reply.reservation)), p.OkReply)
            return reply.reservation

        def cursor(raw: Raw, rid: int) -> int:
            reply = raw.ask(p.Snapshot(rid, 0, 1))
            assert isinstance(reply, p.SnapshotReply), reply
            return reply.cursor

        put = ask_frames(other, p.Put(3, theirs.ns, [b"\1" * 16, b"\2" * 16]),
                         b"\1" * theirs.block_bytes, b"\2" * theirs.block_bytes)
        assert isinstance(put, p.PutReply) and put.created == 2, put
        first, first_cursor = reserve(spy, mine.ns, 10), cursor(other, 11)
        taken = 7
        for i in range(taken):  # the other tenant's requests meanwhile
            reserve(other, theirs.ns, 100 + 2 * i)
            assert cursor(other, 200 + i) != 0
        last, last_cursor = reserve(spy, mine.ns, 20), cursor(other, 21)
        assert last - first not in (1, taken + 1), (first, last)
        assert last_cursor - first_cursor not in (1, taken + 1), (first_cursor, last_cursor)
        ids = [reserve(spy, mine.ns, 300 + 2 * i) for i in range(64)]
        assert len(set(ids)) == len(ids) and all(0 < i < 1 << 63 for i in ids)
        assert ids != sorted(ids)  # (in order by chance: once in 64!)
    finally:
        spy.close()
        other.close()


def test_a_connection_that_ended_its_session_is_told_it_said_goodbye(
        secured: tuple[DaemonProcess, bytes]) -> None:
    """The last connection's goodbye ends the session; what that connection sent next
    was told "this session's lease ran out", which it had not: now that it said
    goodbye, and a hello opens a new session."""
    d, secret = secured
    raw, session = connect(d, secret, "acme")
    try:
        opened = raw.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
        assert isinstance(opened, p.NamespaceReply)
        assert isinstance(raw.ask(p.Bye(3)), p.OkReply)
        for rid in range(4, 4 + 2 * PRE_HELLO_MESSAGES):
            reply = raw.ask(p.Lookup(rid, opened.ns, [b"\7" * 16]))
            assert error_code(reply) == "forbidden" and reply.rid == rid, reply
            assert "said goodbye" in reply.message and "lease" not in reply.message, reply
        again = raw.ask(p.Hello(40, p.PROTOCOL_VERSION, "acme", token_of(secret, "acme")))
        assert isinstance(again, p.HelloReply) and again.session != session
        assert isinstance(raw.ask(p.Ping(41)), p.OkReply)
    finally:
        raw.close()
