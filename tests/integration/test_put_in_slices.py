"""A put larger than a loop turn's copy (``PUT_SLICE_BYTES``) is copied into the arena
a slice a turn: its bytes land exactly as sent, blocks larger than a slice included,
and the daemon answers other clients' requests meanwhile (real daemon process)."""

from __future__ import annotations

import os
import threading
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
