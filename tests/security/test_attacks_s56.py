"""A hostile tenant and an unauthenticated local process against the running daemon:
what the daemon gives out stays each tenant's own, and one tenant's flood leaves the
others served.  Real daemon processes, raw ZeroMQ and unix sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import zmq
from daemon_proc import DaemonProcess

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
