"""A request that waits (deferred for room) while its session's lease runs out: when room
frees, it must not take slots or pins for the session that is gone (they would be held by
no session, outside every cap, until a lease of their own ran out)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from test_attacks import ask
from test_protocol_abuse import Raw, hello

from kvstore import Client
from kvstore import protocol as p
from kvstore.client import Held
from kvstore.errors import LeaseExpiredError, NoSessionError, error_from_code

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
LEASE = 1.0


def deferring_daemon(daemon_factory: Any, tmp_path: Path,
                     lease: float | None = None) -> tuple[Any, Client, Raw]:
    """A daemon of an 8-block DRAM whose reserves wait 30 s for room, a client that
    fills it, and a raw connection (the waiter)."""
    config = tmp_path / "defer.toml"
    config.write_text("[dram]\ndefer_seconds = 30\n")
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       **({"lease": lease} if lease is not None else {}),
                       extra=["--slab-size", str(8 * BIG.block_bytes),
                              "--config", str(config)])
    return d, Client(d.endpoint, tenant="acme"), Raw(d.endpoint)


def reserve_behind_pins(holder: Client, waiter: Raw) -> Held:
    """The holder fills DRAM with its pins; the waiter's session sends a reserve of one
    block (rid 2), which waits for room.  The holder's pin."""
    ns = holder.namespace(BIG)
    keys = ns.keys(range(16 * 8))
    ns.put(keys, [bytes(BIG.block_bytes)] * 8)
    held = ns.acquire(keys)  # the tier is full of pins
    hello(waiter)
    opened = ask(waiter, p.OpenNamespace(1, BIG))
    assert isinstance(opened, p.NamespaceReply)
    waiter.sock.send(p.encoder.encode(p.Reserve(2, opened.ns, [os.urandom(16)])))
    return held


def test_a_deferred_reservation_of_a_session_whose_lease_ran_out_takes_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    d, holder, waiter = deferring_daemon(daemon_factory, tmp_path, lease=LEASE)
    try:
        held = reserve_behind_pins(holder, waiter)
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


def test_a_put_whose_lease_ran_out_while_it_waited_says_so(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    # A client inside a put that waits for room cannot ping.  When its lease ran out
    # meanwhile, the retry found the session's namespaces closed and answered
    # UnknownNamespaceError ("open it first"): the client took its session for alive, and
    # only its next call learned otherwise.  Now the put says the lease ran out, and the
    # client knows at once that it needs a new one.
    config = tmp_path / "defer.toml"
    config.write_text("[dram]\ndefer_seconds = 30\n")
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes), lease=LEASE,
                       extra=["--slab-size", str(8 * BIG.block_bytes),
                              "--config", str(config)])
    holder = Client(d.endpoint, tenant="acme")
    waiter = Client(d.endpoint, tenant="acme", timeout=30)
    outcome: list[BaseException | int] = []
    try:
        ns = holder.namespace(BIG)
        keys = ns.keys(range(16 * 8))
        ns.put(keys, [bytes(BIG.block_bytes)] * 8)
        held = ns.acquire(keys)  # the tier is full of pins
        wns = waiter.namespace(BIG)
        more = wns.keys(range(10_000, 10_000 + 16))

        def put() -> None:
            try:
                outcome.append(wns.put(more, [bytes(BIG.block_bytes)]))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=put)
        thread.start()
        deadline = time.monotonic() + 30
        while holder.stats()["sessions"] > 1:  # (each request renews the holder's lease)
            assert time.monotonic() < deadline, "the waiter's lease never ran out"
            assert not outcome, f"the put was not deferred: {outcome}"
            time.sleep(LEASE / 8)
        held.release()  # room: the deferred put goes on, for a session gone
        thread.join(20)
        assert len(outcome) == 1 and isinstance(outcome[0], LeaseExpiredError), outcome
        with pytest.raises(LeaseExpiredError, match="open a new client"):
            waiter.ping()  # told at once, not after a request of its own
        assert holder.stats()["tiers"]["dram"]["reserved_slots"] == 0
    finally:
        waiter.close()
        holder.close()
    assert d.alive(), d.log()


def test_a_deferred_reservation_of_a_session_that_said_goodbye_is_told_so(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A session's goodbye while a reservation of it waited for room answered it that
    the lease ran out (``lease_expired``), which it never did: the session ended."""
    d, holder, waiter = deferring_daemon(daemon_factory, tmp_path)
    try:
        held = reserve_behind_pins(holder, waiter)
        assert not waiter.sock.poll(500), "the reservation was not deferred"
        waiter.sock.send(p.encoder.encode(p.Bye(3)))
        replies = {}
        while len(replies) < 2:
            assert waiter.sock.poll(10_000), f"unanswered: {replies}"
            reply = p.reply_decoder.decode(waiter.sock.recv_multipart()[0])
            replies[reply.rid] = reply
        assert isinstance(replies[3], p.OkReply), replies
        told = replies[2]
        assert isinstance(told, p.ErrorReply), told
        assert told.code == "forbidden" and "said goodbye" in told.message, told
        assert isinstance(error_from_code(told.code, told.message), NoSessionError)
        assert holder.stats()["tiers"]["dram"]["reserved_slots"] == 0
        held.release()
    finally:
        waiter.close()
        holder.close()
    assert d.alive(), d.log()
