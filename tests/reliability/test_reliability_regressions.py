"""Daemon bugs the reliability tests found, kept as regression tests now that they are fixed."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import zmq
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import protocol as p


def ask(sock: Any, *frames: bytes) -> Any:
    sock.send_multipart(list(frames))
    assert sock.poll(10_000), "no reply"
    return p.reply_decoder.decode(sock.recv_multipart()[0])


def dealer(endpoint: str) -> tuple[zmq.Context[Any], Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return ctx, sock


def test_a_header_with_a_string_that_is_not_utf8_is_malformed(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """msgspec raises UnicodeDecodeError (a ValueError, not a msgspec.DecodeError) for a
    MessagePack str that is not UTF-8.  The daemon catches only DecodeError/ValidationError
    around ``request_decoder.decode`` and ``request_id_of``, so such a header gets an
    "internal" error with request id 0 (the id is lost) and a traceback in the log per
    message (a cheap way to flood the log): it should be "malformed", with the id."""
    d = daemon_factory()
    ctx, sock = dealer(d.endpoint)
    try:
        bad_tag = b"\x92\xa2\xd1\xd1\x05"                      # ["\xd1\xd1", 5]
        bad_tenant = b"\x94\xa5hello\x07\x01\xa2\xff\xfe"     # ["hello", 7, 1, "\xff\xfe"]
        for header, rid in ((bad_tag, 5), (bad_tenant, 7)):
            reply = ask(sock, header)
            assert isinstance(reply, p.ErrorReply)
            assert (reply.code, reply.rid) == ("malformed", rid), reply
    finally:
        sock.close()
        ctx.term()
    assert "UnicodeDecodeError" not in d.log()


def test_put_payload_is_bounded_by_max_request_bytes(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """``server.max_request_bytes`` is "the largest message (put/get payloads) accepted";
    get enforces it, put does not: a put of 240 blocks of 8 KiB (1.9 MiB) is stored by a
    daemon whose limit is 1 MiB.  ZeroMQ's MAXMSGSIZE bounds each frame only, so with
    max_keys_per_request frames of up to (limit + header limit) each, one put can make
    the daemon buffer gigabytes.  Expected: too_large, nothing stored."""
    d = daemon_factory(dram_capacity="4MiB", extra=["--slab-size", "1MiB"],
                       env={"KVSTORE_SERVER_MAX_REQUEST_BYTES": "1MiB"})
    ident = make_identity()
    ctx, sock = dealer(d.endpoint)
    try:
        assert isinstance(ask(sock, p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme"))),
                          p.HelloReply)
        ns = ask(sock, p.encoder.encode(p.OpenNamespace(2, ident))).ns
        keys = [os.urandom(16) for _ in range(240)]
        reply = ask(sock, p.encoder.encode(p.Put(3, ns, keys)),
                    *([b"\1" * ident.block_bytes] * len(keys)))
        assert isinstance(reply, p.ErrorReply) and reply.code == "too_large", reply
    finally:
        sock.close()
        ctx.term()
