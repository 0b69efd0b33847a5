"""Hostile and broken input over a raw socket: typed errors, nothing leaked, still serving."""

from __future__ import annotations

import os

import msgspec
import pytest
import zmq
from kvtest import make_identity
from daemon_proc import DaemonProcess

from kvstore import Client
from kvstore import protocol as p


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes) -> p.Message:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(10_000), "the daemon did not answer"
        reply = self.sock.recv_multipart()
        return p.reply_decoder.decode(reply[0])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def hello(raw: Raw, tenant: str = "acme") -> p.HelloReply:
    reply = raw.ask(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, tenant)))
    assert isinstance(reply, p.HelloReply)
    return reply


def error_code(reply: p.Message) -> str:
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.message
    return reply.code


def test_requests_before_hello_are_forbidden(daemon: DaemonProcess) -> None:
    raw = Raw(daemon.endpoint)
    try:
        assert error_code(raw.ask(p.encoder.encode(p.Stats(3)))) == "forbidden"
        assert error_code(raw.ask(p.encoder.encode(p.Hello(4, 999, "acme")))) == \
            "version_mismatch"
        assert error_code(raw.ask(p.encoder.encode(p.Hello(5, p.PROTOCOL_VERSION, "")))) == \
            "malformed"
    finally:
        raw.close()


@pytest.mark.parametrize("frames", [
    [b""],
    [b"\xc1\xc1\xc1"],                                   # not MessagePack
    [enc(["no-such-verb", 7])],
    [enc(["lookup", 8, "not bytes", ["k"]])],
    [enc(["lookup", 9])],                                # missing fields
    [enc({"op": "lookup"})],
    [enc(["commit", 11, "one"])],
    [enc(["open", 12, {"model": "m"}])],                 # an identity missing fields
    [enc(["open", 13, {"model": "m", "model_revision": "r", "tenant": "acme",
                       "kv_dtype": "float7", "num_layers": 1, "num_kv_heads": 1,
                       "head_dim": 1, "block_tokens": 1}])],
    [enc(["ping", -1])],
    [b"\x92\xa4ping\xcf" + b"\xff" * 8],             # rid beyond int64
    [os.urandom(64)],
    [b"\x91" * 100_000],                                 # deeply nested arrays
])
def test_malformed_headers_get_a_typed_error(module_daemon: DaemonProcess,
                                            frames: list[bytes]) -> None:
    """Each case on a session of its own, asking nothing of the store: one daemon takes
    them all in turn."""
    raw = Raw(module_daemon.endpoint)
    try:
        hello(raw)
        assert error_code(raw.ask(*frames)) == "malformed"
        assert isinstance(raw.ask(p.encoder.encode(p.Ping(99))), p.OkReply)
    finally:
        raw.close()
    assert module_daemon.alive()


def test_bad_requests_leave_nothing_behind(daemon: DaemonProcess) -> None:
    raw = Raw(daemon.endpoint)
    try:
        facts = hello(raw)
        ident = make_identity()
        opened = raw.ask(p.encoder.encode(p.OpenNamespace(2, ident)))
        assert isinstance(opened, p.NamespaceReply)
        ns = opened.ns
        key = os.urandom(16)
        too_many = [os.urandom(16) for _ in range(facts.max_keys + 1)]
        cases = [
            ([p.encoder.encode(p.Lookup(3, os.urandom(16), [key]))], "unknown_namespace"),
            ([p.encoder.encode(p.Lookup(4, ns, too_many))], "too_large"),
            ([p.encoder.encode(p.Reserve(5, ns, too_many))], "too_large"),
            ([p.encoder.encode(p.Reserve(6, ns, [b"short"]))], "malformed"),
            ([p.encoder.encode(p.Put(7, ns, [key, os.urandom(16)])), b"\0" * ident.block_bytes],
             "malformed"),
            ([p.encoder.encode(p.Put(8, ns, [key])), b"\0" * 10], "malformed"),
            ([p.encoder.encode(p.Put(9, ns, [key], parent=os.urandom(16))),
              b"\0" * ident.block_bytes], "not_found"),
            ([p.encoder.encode(p.Commit(10, 12345))], "not_found"),
            ([p.encoder.encode(p.Abort(11, 12345))], "not_found"),
            ([p.encoder.encode(p.Release(12, 12345))], "not_found"),
            ([p.encoder.encode(p.Acquire(13, ns, [key]))], "not_found"),
            ([p.encoder.encode(p.Get(14, ns, [key]))], "not_found"),
            ([b"\x92" + b"\xa4ping" + b"\x01" + b"x" * (p.MAX_HEADER_BYTES + 1)], "too_large"),
        ]
        for frames, code in cases:
            reply = raw.ask(*frames)
            assert error_code(reply) == code, (frames[0][:40], reply)
            assert reply.rid in (0, p.request_id_of(frames[0]))
        with Client(daemon.endpoint, tenant="acme") as client:
            stats = client.stats()
            tier = stats["tiers"]["dram"]
            assert tier["reserved"] == 0 and tier["committed"] == 0
            assert tier["pinned_blocks"] == 0
            assert stats["invariant_violations"] == 0
    finally:
        raw.close()
    assert daemon.alive()


def test_random_garbage_never_kills_the_daemon(daemon: DaemonProcess) -> None:
    import random

    rng = random.Random(1234)
    raw = Raw(daemon.endpoint)
    try:
        hello(raw)
        for i in range(300):
            n = rng.randrange(1, 4)
            frames = [rng.randbytes(rng.randrange(0, 200)) for _ in range(n)]
            if i % 3 == 0:  # a valid tag with junk after it, to get past the first check
                frames[0] = enc([rng.choice(["lookup", "reserve", "put", "get", "commit",
                                             "acquire", "release", "open", "stats"]),
                                 i, *[rng.randbytes(8) for _ in range(rng.randrange(4))]])
            reply = raw.ask(*frames)
            assert isinstance(reply, (p.ErrorReply, p.StatsReply)), reply
    finally:
        raw.close()
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(64))
        ns.put(keys, [b"\1" * ns.block_bytes] * 4)
        assert ns.get(keys) == [b"\1" * ns.block_bytes] * 4
        assert client.stats()["invariant_violations"] == 0


@pytest.mark.parametrize("checksum", [-1, -(1 << 63)])
def test_a_negative_checksum_is_refused_and_the_reservation_kept(
        daemon: DaemonProcess, checksum: int) -> None:
    """Before, a negative one was taken: the writer's own SSD copy then read back as
    damaged."""
    raw = Raw(daemon.endpoint)
    try:
        hello(raw)
        ident = make_identity()
        opened = raw.ask(p.encoder.encode(p.OpenNamespace(2, ident)))
        assert isinstance(opened, p.NamespaceReply)
        key = os.urandom(16)
        put = raw.ask(enc(["put", 3, opened.ns, [key], None, [checksum]]),
                      b"\0" * ident.block_bytes)
        assert error_code(put) == "malformed", put
        reserved = raw.ask(p.encoder.encode(p.Reserve(4, opened.ns, [key])))
        assert isinstance(reserved, p.ReserveReply), reserved
        commit = raw.ask(enc(["commit", 5, reserved.reservation, [checksum]]))
        assert error_code(commit) == "malformed", commit
        committed = raw.ask(p.encoder.encode(p.Commit(6, reserved.reservation, [7])))
        assert isinstance(committed, p.CommitReply), committed
    finally:
        raw.close()
    with Client(daemon.endpoint, tenant="acme") as client:
        tier = client.stats()["tiers"]["dram"]
        assert tier["reserved"] == 0 and tier["committed_slots"] == 1
        assert client.stats()["invariant_violations"] == 0
