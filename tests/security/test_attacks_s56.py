"""A hostile tenant and an unauthenticated local process against the running daemon:
what the daemon gives out stays each tenant's own, and one tenant's flood leaves the
others served.  Real daemon processes, raw ZeroMQ and unix sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import protocol as p
from kvstore.auth import _TICKETS_HELD, issue_token, read_secret, write_secret
from kvstore.tiers.arena_fds import admit, side_path


def token_daemon(daemon_factory: Any, tmp_path: Path) -> tuple[DaemonProcess, bytes]:
    """A daemon whose ipc endpoint takes tokens (a ticket of its side socket each
    handshake), and its secret."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n')
    daemon = daemon_factory(extra=["--config", str(config)])
    return daemon, read_secret(secret_file)


def hello_with(endpoint: str, admission: tuple[str, str]) -> p.Message | None:
    """A hello over a connection whose handshake presents ``admission`` (tenant,
    ticket); its reply, or None when the handshake is refused (no reply comes)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.plain_username = admission[0].encode()
    sock.plain_password = admission[1].encode()
    try:
        sock.connect(endpoint)
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, admission[0])))
        if not sock.poll(3000):
            return None
        return p.reply_decoder.decode(sock.recv())
    finally:
        sock.close()
        ctx.term()


def test_one_tenants_flood_of_tickets_leaves_another_tenants_ticket_good(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The side socket hands a client a one-time ticket for its handshake; the daemon
    held the last 4096 of all tenants' in one queue, the oldest dropped past it.  A
    tenant with a good token that asked for 4096 tickets (a few seconds of requests, and
    again and again) dropped every other tenant's ticket between its hand-out and the
    handshake that presents it: their clients could not connect.  A flood now drops the
    oldest tickets of the tenant holding the most, its own."""
    daemon, secret = token_daemon(daemon_factory, tmp_path)
    side = side_path(daemon.endpoint)
    assert side is not None
    victim = admit(side, issue_token(secret, "beta", 3600))
    assert victim is not None and victim[0] == "beta"
    flood = issue_token(secret, "acme", 3600)
    last = None
    for _ in range(_TICKETS_HELD):
        last = admit(side, flood)
    assert last is not None and last[0] == "acme"
    reply = hello_with(daemon.endpoint, victim)
    assert isinstance(reply, p.HelloReply) and reply.tenant == "beta", reply
    # the flooder's newest ticket is good too: only its own oldest went
    reply = hello_with(daemon.endpoint, last)
    assert isinstance(reply, p.HelloReply) and reply.tenant == "acme", reply
    assert daemon.alive()


class Peer:
    """A raw DEALER connection with a session of ``tenant``."""

    def __init__(self, endpoint: str, tenant: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        assert isinstance(self.ask(p.Hello(1, p.PROTOCOL_VERSION, tenant)), p.HelloReply)

    def send(self, request: p.Message, *payload: bytes) -> None:
        self.sock.send_multipart([p.encoder.encode(request), *payload])

    def reply(self, seconds: float = 10.0) -> p.Message | None:
        if not self.sock.poll(seconds * 1000):
            return None
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def ask(self, request: p.Message, *payload: bytes) -> p.Message | None:
        self.send(request, *payload)
        return self.reply()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


MOST = 6  # server.max_requests_under_way in the test below


def test_one_tenant_cannot_take_the_daemons_whole_bound_on_work_under_way(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The daemon holds at most ``server.max_requests_under_way`` requests waiting in
    tasks (reserves waiting for room, reads, prefetches) over every session; a tenant's
    sessions could take all of them (here one session's six reserves, deferred behind
    DRAM full of its own pins), and then every other tenant's request that had to wait
    was refused with ``limit_exceeded`` until they ended.  A tenant now holds at most
    half of the bound: its own past that are refused, another tenant's wait as before."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f"[server]\nmax_requests_under_way = {MOST}\n"
                      '[dram]\npressure = ["evict", "defer", "reject"]\n'
                      "defer_seconds = 30\n")
    d = daemon_factory(tcp=True, dram_capacity="2MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    assert d.tcp_endpoint is not None
    hog, other = Peer(d.tcp_endpoint, "acme"), Peer(d.tcp_endpoint, "globex")
    try:
        opened = hog.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
        assert isinstance(opened, p.NamespaceReply), opened
        slots = (2 << 20) // opened.slot_bytes
        full = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
        put = hog.ask(p.Put(3, opened.ns, full), *[b"\1" * opened.block_bytes] * slots)
        assert isinstance(put, p.PutReply) and put.created == slots, put
        held = hog.ask(p.Acquire(4, opened.ns, full))  # DRAM full of pins: reserves wait
        assert isinstance(held, p.AcquireReply), held
        for i in range(MOST):
            hog.send(p.Reserve(100 + i, opened.ns, [bytes([200 + i]) * 16]))
        refused = [hog.reply() for _ in range(MOST // 2)]
        assert all(isinstance(r, p.ErrorReply) and r.code == "limit_exceeded"
                   for r in refused), refused
        assert hog.reply(0.3) is None  # the first half wait for room
        mine = other.ask(p.OpenNamespace(2, make_identity(tenant="globex")))
        assert isinstance(mine, p.NamespaceReply), mine
        other.send(p.Reserve(3, mine.ns, [b"\3" * 16]))
        assert other.reply(0.5) is None  # waits for room too: not refused
        assert isinstance(hog.ask(p.Release(5, held.pin)), p.OkReply)
        served = other.reply()
        assert isinstance(served, p.ReserveReply), served
        ended = [hog.reply() for _ in range(MOST // 2)]
        assert all(isinstance(r, p.ReserveReply) for r in ended), ended
        stats = other.ask(p.Stats(6))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["under_way"] == {"requests": 0, "keys": 0}
    finally:
        hog.close()
        other.close()
