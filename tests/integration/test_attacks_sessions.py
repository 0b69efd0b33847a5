"""A connection authenticated as one tenant that takes the routing id of another
tenant's connection once that one has gone (any peer may name its own routing id, and a
session outlives its connection until its lease ends): its requests must not be served
as the other tenant's session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq
from kvtest import make_identity

from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret

IDENT_A = make_identity(tenant="acme")


def _dealer(ctx: zmq.Context[Any], endpoint: str, tenant: str, token: str,
            routing_id: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.plain_username, sock.plain_password = tenant.encode(), token.encode()
    sock.connect(endpoint)
    return sock


def _connect_as(ctx: zmq.Context[Any], endpoint: str, tenant: str, token: str,
                routing_id: bytes, msg: p.Message) -> tuple[zmq.Socket[bytes], p.Message,
                                                            list[bytes]]:
    """A connection naming ``routing_id`` that got an answer to ``msg``: until the daemon
    has seen the last holder of that id go, ZeroMQ does not take the id (nor the message)."""
    for _ in range(100):
        sock = _dealer(ctx, endpoint, tenant, token, routing_id)
        sock.send(p.encoder.encode(msg))
        if sock.poll(200):
            frames = sock.recv_multipart()
            return sock, p.reply_decoder.decode(frames[0]), frames[1:]
        sock.close(linger=0)
    raise AssertionError("the routing id was never free again")


def _ask(sock: zmq.Socket[bytes], msg: p.Message, *payload: bytes) -> tuple[p.Message,
                                                                           list[bytes]]:
    sock.send_multipart([p.encoder.encode(msg), *payload])
    assert sock.poll(10_000), "the daemon did not answer"
    frames = sock.recv_multipart()
    return p.reply_decoder.decode(frames[0]), frames[1:]


def test_a_routing_id_taken_over_by_another_tenant_gets_no_session(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret_file)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n')
    daemon = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert daemon.tcp_endpoint is not None
    secret = read_secret(secret_file)
    token_a, token_b = issue_token(secret, "acme", 600), issue_token(secret, "globex", 600)
    routing_id = b"victim-" + os.urandom(4)  # a guess of the attacker's, right here
    ctx = zmq.Context()
    try:
        owner = _dealer(ctx, daemon.tcp_endpoint, "acme", token_a, routing_id)
        assert isinstance(_ask(owner, p.Hello(1, p.PROTOCOL_VERSION, "acme"))[0],
                          p.HelloReply)
        ns = _ask(owner, p.OpenNamespace(2, IDENT_A))[0]
        assert isinstance(ns, p.NamespaceReply)
        keys = [os.urandom(16)]
        secret_bytes = b"\x5a" * IDENT_A.block_bytes
        assert isinstance(_ask(owner, p.Put(3, ns.ns, keys), secret_bytes)[0], p.PutReply)
        owner.close()  # gone; its session stays until its lease ends

        thief, reply, frames = _connect_as(ctx, daemon.tcp_endpoint, "globex", token_b,
                                           routing_id, p.Get(4, ns.ns, keys))
        assert isinstance(reply, p.ErrorReply) and reply.code == "forbidden", reply
        assert secret_bytes not in frames
        reply, _ = _ask(thief, p.DropNamespace(5, ns.ns))
        assert isinstance(reply, p.ErrorReply) and reply.code == "forbidden", reply
        thief.close()

        # the owner coming back on its routing id still has its session
        again, reply, frames = _connect_as(ctx, daemon.tcp_endpoint, "acme", token_a,
                                           routing_id, p.Get(6, ns.ns, keys))
        assert isinstance(reply, p.GetReply) and frames == [secret_bytes], reply
        again.close()
    finally:
        ctx.destroy(linger=0)
    assert daemon.alive(), daemon.log()
