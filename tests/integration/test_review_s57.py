"""Second reading of the commits that wait for other writers and of the slab budget over
per-tenant arenas, against real daemons: the cases that failed, kept."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import protocol as p
from kvstore.client import Client
from kvstore.client_wire import check_reply
from kvstore.errors import MalformedError
from kvstore.keys import chain_keys

# 128 KiB blocks: a 16 MiB arena holds 128 of them
WRITERS = make_identity(model="review-s57", num_kv_heads=8, head_dim=128)


def test_an_arena_holding_the_whole_budget_makes_room_by_emptying_one_of_its_slabs(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """One tenant's arena holds every slab of the budget; a put evicts the last block of
    a slab (the coldest).  With the slab's pages given back on a thread, the arena could
    not take it again meanwhile and had no other: 'internal error: allocation failed
    after making room', the victim evicted for nothing.  The put stores its blocks."""
    config = tmp_path / "arenas.toml"
    config.write_text('[dram]\nslab_size = "1MiB"\narena_kind = "memfd"\n'
                      'per_tenant_arenas = true\neviction_policy = "lru"\n')
    d = daemon_factory(dram_capacity="16MiB", extra=["--config", str(config)])
    c = Client(d.endpoint)
    try:
        ns = c.namespace(make_identity(tenant="default", head_dim=128))  # 32 KiB blocks
        block = ns.identity.block_bytes
        per = (1 << 20) // block  # blocks a slab

        def keys(first: int, count: int) -> list[bytes]:
            return [chain_keys(ns.id, list(range(n * 16, n * 16 + 16)), 16)[0]
                    for n in range(first, first + count)]

        first = keys(0, per)
        ns.put(first, [b"a" * block] * per)  # the first slab, oldest
        for s in range(15):  # every other slab of the budget
            ns.put(keys(1000 + s * per, per), [b"b" * block] * per)
        dram = c.stats()["tiers"]["dram"]
        assert dram["budget_slabs"] == 16 and dram["free"] == 0
        assert ns.evict(first[1:]) == per - 1  # the first slab: one block, the coldest
        new = keys(5000, per)
        assert ns.put(new, [b"c" * block] * per) == per  # one slot more than free
        assert ns.get(new) == [b"c" * block] * per
        stats = c.stats()
        assert stats["tiers"]["dram"]["blocks"] == 15 * per + per
        assert stats["invariant_violations"] == 0
    finally:
        c.close()


def test_a_commit_waits_for_no_writer_that_waits_for_its_own_sessions_reservation(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Session A holds k1 open; B reserves k1 (awaited: A's) and k2; A reserves k1..k3,
    k2 awaited from B, and commits that before its k1 (as a client committing in its own
    order does).  A's commit waited for B's, B's for A's first reservation, which A
    commits only after this reply: both waited out the bound (half a lease), then stored
    1 of the 3 blocks, 4 keys dropped.  A key that a writer awaiting (through others) one
    of the session's own reservations holds now takes a slot, as one of its own does."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)  # (a wait's bound: 2 s)
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b:
        na, nb = a.namespace(WRITERS), b.namespace(WRITERS)
        keys = na.keys(range(3 * WRITERS.block_tokens))
        data = {k: os.urandom(na.block_bytes) for k in keys}
        first = na.reserve(keys[:1])
        other = nb.reserve(keys[:2])
        assert other.offsets[0] == -1  # (awaited from A's first)
        mine = na.reserve(keys)
        assert min(mine.offsets) >= 0, mine.offsets  # k2: a slot, not B's awaited
        for r in (first, other, mine):
            for key, buf, offset in zip(r.keys, r.buffers, r.offsets):
                if offset >= 0:
                    buf[:] = data[key]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(other.commit)
            deadline = time.monotonic() + 20
            while a.stats()["tiers"]["dram"]["commits_waited"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert mine.commit() == 3 and mine.dropped == 0
            assert first.commit() == 0  # (a duplicate: stored by the second)
            assert waiting.result(timeout=30) == 0 and other.dropped == 0
        dram = a.stats()["tiers"]["dram"]
        assert (dram["commit_wait_timeouts"], dram["awaited_dropped"]) == (0, 0), dram
        assert (dram["reserved_slots"], dram["pinned_blocks"], dram["blocks"]) == (0, 0, 3)
        assert nb.get(keys) == [data[k] for k in keys]


def test_a_second_commit_of_a_waiting_reservation_is_refused_and_the_first_goes_on(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A client that sends a reservation's commit twice while the first waits for an
    older writer: the second took the first's wake-up, the first waited out the bound
    (half a lease), then failed with 'internal error: KeyError'.  Now the second is
    refused at once (malformed), and the first commits once the writer has."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)  # (a wait's bound: 2 s)
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b:
        na, nb = a.namespace(WRITERS), b.namespace(WRITERS)
        keys = na.keys(range(2 * WRITERS.block_tokens))
        first = na.reserve(keys[:1])
        second = nb.reserve(keys)
        assert second.offsets[0] == -1
        once, twice = (p.Commit(b._next_rid(), second.id) for _ in range(2))
        b._send(once)
        b._send(twice)
        with pytest.raises(MalformedError, match="waiting already"):
            check_reply(b._wait(twice.rid)[0], p.CommitReply)
        assert first.commit() == 1
        reply = check_reply(b._wait(once.rid)[0], p.CommitReply)
        assert (reply.created, reply.duplicates, reply.dropped) == (1, 1, 0)
        dram = a.stats()["tiers"]["dram"]
        assert (dram["commit_wait_timeouts"], dram["reserved_slots"], dram["blocks"]) == (
            0, 0, 2), dram
    assert "internal error" not in d.log()


def test_a_commit_waits_no_longer_than_an_engines_link_waits_for_its_reply(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A writer holds its reservation open (an engine stuck, or killed: its session lives
    till its lease ends); another engine's commit of the same prefix waited half a lease
    (15 s), but the engines' links wait 5 s (vLLM) or 10 s for a reply: the link took the
    daemon for gone, backed off and dropped its session.  Now the wait ends first and
    the commit stores what it can (nothing after the missing key)."""
    d = daemon_factory(dram_capacity="16MiB")  # (the default lease, 30 s)
    with Client(d.endpoint, tenant="acme") as a, \
            Client(d.endpoint, tenant="acme", timeout=5.0) as b:  # (as vLLM's link)
        na, nb = a.namespace(WRITERS), b.namespace(WRITERS)
        keys = na.keys(range(2 * WRITERS.block_tokens))
        first = na.reserve(keys[:1])  # (never committed while the other waits)
        second = nb.reserve(keys)
        assert second.offsets[0] == -1
        assert second.commit() == 0 and second.dropped == 2
        dram = b.stats()["tiers"]["dram"]
        assert (dram["commit_wait_timeouts"], dram["awaited_dropped"]) == (1, 2), dram
        assert first.commit() == 1
        b.ping()  # (the session lives on)


def test_an_older_clients_skip_held_gives_keys_pending_elsewhere_a_slot(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A client of before the awaited keys sends skip_held (for keys held in DRAM) and
    reads no ``dropped`` in the commit reply.  Its reserve gave keys pending in another
    writer's reservation no slot; that writer aborted, and the commit stored none of the
    keys from there on while the client took them all for stored (the LMCache adapter
    told LMCache it held them).  Now such a client gets a slot for them, as before; a
    client that reads ``dropped`` says so (skip_pending)."""
    d = daemon_factory(dram_capacity="16MiB")
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b:
        na, nb = a.namespace(WRITERS), b.namespace(WRITERS)
        keys = na.keys(range(3 * WRITERS.block_tokens))
        first = na.reserve(keys[:2])
        newer = nb.reserve(keys)  # (the client's own: skip_pending)
        assert newer.offsets[:2] == [-1, -1]
        older = check_reply(b._call(p.Reserve(b._next_rid(), nb.id, keys, None,
                                              skip_held=True))[0], p.ReserveReply)
        assert min(older.offsets) >= 0, older.offsets  # (as it was: a slot each)
        first.abort()
        newer.abort()
        done = check_reply(b._call(p.Commit(b._next_rid(), older.reservation))[0],
                           p.CommitReply)
        assert (done.created, done.dropped) == (3, 0)
        assert nb.lookup(keys).blocks == 3
