"""A request that waits (deferred for room) while its session's lease runs out: when room
frees, it must not take slots or pins for the session that is gone (they would be held by
no session, outside every cap, until a lease of their own ran out)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvtest import make_identity
from test_attacks import ask
from test_protocol_abuse import Raw, hello

from kvstore import Client
from kvstore import protocol as p

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
LEASE = 1.0


def test_a_deferred_reservation_of_a_session_whose_lease_ran_out_takes_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "defer.toml"
    config.write_text("[dram]\ndefer_seconds = 30\n")
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes), lease=LEASE,
                       extra=["--slab-size", str(8 * BIG.block_bytes),
                              "--config", str(config)])
    holder = Client(d.endpoint, tenant="acme")
    waiter = Raw(d.endpoint)
    try:
        ns = holder.namespace(BIG)
        keys = ns.keys(range(16 * 8))
        ns.put(keys, [bytes(BIG.block_bytes)] * 8)
        held = ns.acquire(keys)  # the tier is full of pins
        hello(waiter)
        opened = ask(waiter, p.OpenNamespace(1, BIG))
        assert isinstance(opened, p.NamespaceReply)
        waiter.sock.send(p.encoder.encode(p.Reserve(2, opened.ns, [os.urandom(16)])))
        deadline = time.monotonic() + 30
        while holder.stats()["sessions"] > 1:  # (each request renews the holder's lease)
            assert time.monotonic() < deadline, "the waiter's lease never ran out"
            assert not waiter.sock.poll(0), "the reservation was not deferred"
            time.sleep(LEASE / 8)
        held.release()  # room: the deferred reservation goes on, for a session gone
        assert waiter.sock.poll(10_000), "the deferred reservation was never answered"
        reply = p.reply_decoder.decode(waiter.sock.recv_multipart()[0])
        # (its session's namespaces closed with it: the retry finds none open)
        assert isinstance(reply, p.ErrorReply), reply
        assert reply.code in ("lease_expired", "unknown_namespace"), reply
        assert holder.stats()["tiers"]["dram"]["reserved_slots"] == 0
    finally:
        waiter.close()
        holder.close()
    assert d.alive(), d.log()
