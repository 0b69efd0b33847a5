"""A put larger than a loop turn's copy (``PUT_SLICE_BYTES``) is copied into the arena
a slice a turn: its bytes land exactly as sent, blocks larger than a slice included,
and the daemon answers other clients' requests meanwhile (real daemon process)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.verbs import PUT_SLICE_BYTES

# 2 layers x 2 x 1024 heads x 128 x fp16 x 16 tokens = 16 MiB a block: two slices each
BIG = make_identity(model="big-blocks", num_kv_heads=1024, head_dim=128)
SMALL = make_identity(model="small-blocks", num_layers=64, num_kv_heads=8, head_dim=128)


def test_a_put_over_a_slice_lands_exactly_and_others_are_served(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="256MiB")
    assert BIG.block_bytes > PUT_SLICE_BYTES
    with Client(d.endpoint, tenant="acme") as c, Client(d.endpoint, tenant="globex") as other:
        big = c.namespace(BIG)
        blocks = [os.urandom(big.block_bytes) for _ in range(3)]
        keys = big.keys(range(3 * BIG.block_tokens))
        small = c.namespace(SMALL)  # many blocks of a few MiB in all
        assert 4 * small.block_bytes * 8 > PUT_SLICE_BYTES
        small_blocks = [os.urandom(small.block_bytes) for _ in range(32)]
        small_keys = small.keys(range(32 * SMALL.block_tokens))
        pings: list[int] = []
        stop = threading.Event()

        def ping() -> None:  # another client's requests while the puts copy
            while not stop.is_set():
                other.ping()
                pings.append(1)

        t = threading.Thread(target=ping)
        t.start()
        try:
            created = big.put(keys, blocks)
            small.put(small_keys, small_blocks)
        finally:
            stop.set()
            t.join(30)
        assert created == 3
        assert big.get(keys) == blocks
        assert small.get(small_keys) == small_blocks
        assert pings, "the other client was never answered"
        dram = c.stats()["tiers"]["dram"]
        assert dram["reserved_slots"] == 0 and dram["blocks"] == 35


def test_a_put_that_makes_room_first_counts_its_reservation_while_it_copies(
        daemon_factory: Any) -> None:
    """A put that must demote blocks first (a plan) takes its reservation in the task
    that finishes it, then copies in slices: the reservation counts to its session from
    then on, so the invariant check after another session's request meanwhile finds the
    counts right (it found the session holding a reservation it had not counted)."""
    from test_attacks import ask
    from test_protocol_abuse import Raw, hello

    from kvstore import protocol as p

    ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=128, block_tokens=32)
    d = daemon_factory(dram_capacity="32MiB", ssd_capacity="256MiB",
                       extra=["--slab-size", "4MiB"])
    size = ident.block_bytes  # 256 KiB: 128 slots, and a put of 40 is over a slice
    with Client(d.endpoint, tenant="acme") as c:  # DRAM full of cold blocks
        ns = c.namespace(ident)
        for _ in range(4):
            ns.put([os.urandom(16) for _ in range(32)], [bytes(size)] * 32)
    writer, other = Raw(d.endpoint), Raw(d.endpoint)
    try:
        hello(writer)
        hello(other, "globex")
        opened = ask(writer, p.OpenNamespace(1, ident))
        assert isinstance(opened, p.NamespaceReply)
        count = 40
        assert count * size > PUT_SLICE_BYTES
        keys = [os.urandom(16) for _ in range(count)]
        writer.sock.send_multipart([p.encoder.encode(p.Put(2, opened.ns, keys)),
                                    *[os.urandom(size) for _ in range(count)]])
        for i in range(300):  # another session's requests while the put makes room, copies
            other.sock.send(p.encoder.encode(p.Ping(10 + i)))
        for _ in range(300):
            assert other.sock.poll(10_000)
            other.sock.recv_multipart()
        assert writer.sock.poll(10_000)
        reply = p.reply_decoder.decode(writer.sock.recv_multipart()[0])
        assert isinstance(reply, p.PutReply) and reply.created == count, reply
        with Client(d.endpoint, tenant="audit") as c:
            stats = c.stats()
        assert stats["tiers"]["dram"]["reserved_slots"] == 0
        assert stats["invariant_violations"] == 0
    finally:
        writer.close()
        other.close()


def test_a_put_refused_for_bytes_in_flight_leaves_no_reservation(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A put over a slice takes its reservation at once and leaves the copy to a task; a
    session with ``max_bytes_in_flight`` under way (get replies its peer has not read)
    is refused it (limit_exceeded), and the reservation goes back with the refusal (it
    stayed held, with no id to abort it by, as long as the session lived)."""
    import zmq

    from test_attacks import ask, held

    from kvstore import protocol as p

    ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=128, block_tokens=32)
    config = tmp_path / "limits.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "16MiB"\n')
    d = daemon_factory(dram_capacity="256MiB", extra=["--config", str(config)])
    size = ident.block_bytes  # 256 KiB
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # a peer that reads nothing: replies stay unsent
    sock.setsockopt(zmq.RCVBUF, 65536)
    sock.connect(d.endpoint)

    class Peer:  # (what ``ask`` needs of a raw client)
        def ask(self, *frames: bytes) -> p.Message:
            sock.send_multipart(list(frames))
            assert sock.poll(10_000), "the daemon did not answer"
            return p.reply_decoder.decode(sock.recv_multipart()[0])

    peer = Peer()
    try:
        assert isinstance(ask(peer, p.Hello(1, p.PROTOCOL_VERSION, "acme")), p.HelloReply)
        opened = ask(peer, p.OpenNamespace(2, ident))
        assert isinstance(opened, p.NamespaceReply)
        keys = [os.urandom(16) for _ in range(64)]  # 16 MiB
        assert isinstance(ask(peer, p.Put(3, opened.ns, keys),
                              *[os.urandom(size) for _ in keys]), p.PutReply)
        for i in range(8):  # 16 MiB a reply, unread: the session's limit under way
            sock.send(p.encoder.encode(p.Get(10 + i, opened.ns, keys)))
        count = 40
        assert count * size > PUT_SLICE_BYTES
        sock.send_multipart([p.encoder.encode(p.Put(20, opened.ns,
                                                    [os.urandom(16) for _ in range(count)])),
                             *[bytes(size)] * count])
        deadline = time.monotonic() + 10
        replies: dict[int, p.Message] = {}
        while 20 not in replies:
            assert time.monotonic() < deadline, f"no reply to the put: {replies}"
            if sock.poll(100):
                reply = p.reply_decoder.decode(sock.recv_multipart()[0])
                replies[reply.rid] = reply
        refused = replies[20]
        assert isinstance(refused, p.ErrorReply) and refused.code == "limit_exceeded", refused
        assert held(d)[0] == 0  # no slot left reserved
    finally:
        sock.close()
        ctx.term()
