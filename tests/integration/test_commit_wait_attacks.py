"""Clients that misuse the commits waiting for other writers, against real daemons: a
writer that never commits, pipelined commits, reservations ending while others wait."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity, settled, tenants_daemon, written

from kvstore import protocol as p
from kvstore.aclient import AsyncClient
from kvstore.client import Client
from kvstore.client_core import PlanItem
from kvstore.client_wire import check_reply
from kvstore.errors import MalformedError, NotFoundError

# 128 KiB blocks: a 16 MiB arena holds 128 of them
WRITERS = make_identity(model="commit-wait-attacks", num_kv_heads=8, head_dim=128)


def _dram(c: Client) -> dict[str, int]:
    return c.stats()["tiers"]["dram"]


def test_a_writer_that_never_commits_stalls_each_peer_once_not_every_commit(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Session H reserves the first key of a prefix and holds it open, renewing its lease
    (an engine stuck, or a careless client), and later aborts and reserves it again.  Every
    commit of every peer saving that prefix waited out the bound (half a lease, at most
    2.5 s) and then dropped all its blocks, for as long as H lived.  Now a session whose
    reservation a commit waited out the bound for is awaited by no reserve for a lease:
    the peer's next reserves take a slot for that key and store the whole prefix."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)  # (a wait's bound: 2 s)
    with Client(d.endpoint, tenant="acme") as h, Client(d.endpoint, tenant="acme") as v:
        nh, nv = h.namespace(WRITERS), v.namespace(WRITERS)
        keys = nv.keys(range(3 * WRITERS.block_tokens))
        data = [os.urandom(nv.block_bytes) for _ in keys]
        stuck = nh.reserve(keys[:1])
        first = nv.reserve(keys)
        assert first.offsets[0] == -1  # (awaited from H's)
        assert first.commit() == 0 and first.dropped == 3  # the bound, once
        stuck.abort()
        stuck = nh.reserve(keys[:1])  # (a new reservation of the same session)
        h.ping()
        for n in range(3):
            again = nv.reserve(keys)
            assert min(again.offsets) >= 0, (n, again.offsets)
            again.abort()
        assert nv.put(keys, data) == 3
        assert nv.get(keys) == data
        dram = _dram(v)
        assert (dram["commits_waited"], dram["commit_wait_timeouts"]) == (1, 1), dram
        assert dram["awaited_dropped"] == 3, dram
        stuck.abort()
        dram = settled(v)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram
    assert "invariant violated" not in d.log()


def test_peers_waiting_at_once_for_a_writer_that_never_commits_wait_out_one_bound(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Two peers' commits wait for the same stuck writer, the second's from a second later.
    Once the first has waited out the bound, the other awaits that writer no more: it
    goes on at once (what is cached stored) rather than waiting out a bound of its own."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)
    with Client(d.endpoint, tenant="acme") as h, Client(d.endpoint, tenant="acme") as a, \
            Client(d.endpoint, tenant="acme") as b:
        nh, na, nb = h.namespace(WRITERS), a.namespace(WRITERS), b.namespace(WRITERS)
        keys = na.keys(range(2 * WRITERS.block_tokens))
        stuck = nh.reserve(keys[:1])
        ra = na.reserve(keys)
        ca = p.Commit(a._next_rid(), ra.id)
        a._send(ca)
        time.sleep(1.0)  # (B's own bound would end a second after A's)
        rb = nb.reserve(keys)
        assert ra.offsets[0] == rb.offsets[0] == -1
        cb = p.Commit(b._next_rid(), rb.id)
        b._send(cb)
        for c, req in ((a, ca), (b, cb)):
            reply = check_reply(c._wait(req.rid)[0], p.CommitReply)
            assert (reply.created, reply.dropped) == (0, 2), reply
        dram = _dram(a)
        assert (dram["commits_waited"], dram["commit_wait_timeouts"]) == (2, 1), dram
        stuck.abort()
        dram = settled(a)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_writer_whose_own_commit_waits_is_not_taken_for_one_that_never_commits(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """X holds k0 open and never commits; W reserves k0..k1 (k0 awaited from X); V reserves
    k0..k2 (k0 from X, k1 from W) and commits, then W commits: both wait for X.  V's wait
    runs out first; W, blocked by X as V was, is no writer that never commits: it is
    awaited still (a later reserve of V gets no slot for a key W holds one for)."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)
    with Client(d.endpoint, tenant="acme") as x, Client(d.endpoint, tenant="acme") as w, \
            Client(d.endpoint, tenant="acme") as v, ThreadPoolExecutor(2) as pool:
        nx, nw, nv = (c.namespace(WRITERS) for c in (x, w, v))
        keys = nv.keys(range(3 * WRITERS.block_tokens))
        stuck = nx.reserve(keys[:1])
        rw = nw.reserve(keys[:2])
        rv = nv.reserve(keys[:3])
        assert (rw.offsets[0], rv.offsets[:2]) == (-1, [-1, -1])
        v_done = pool.submit(rv.commit)
        time.sleep(1.0)  # (W's wait would run out a second after V's)
        w_done = pool.submit(rw.commit)
        assert (v_done.result(), rv.dropped) == (0, 3)
        assert (w_done.result(), rw.dropped) == (0, 2)
        other = nv.keys(range(1000 * WRITERS.block_tokens, 1003 * WRITERS.block_tokens))
        later = nw.reserve(other[:2])
        mine = nv.reserve(other)
        assert mine.offsets[:2] == [-1, -1], mine.offsets  # (awaited from W's)
        for r in (later, mine, stuck):
            r.abort()
        dram = settled(v)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_malformed_commit_is_refused_at_once_not_after_the_wait(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A commit of a reservation awaiting an open writer's key, with two checksums for its
    three blocks: it waited for the writer (here the whole bound, and the writer was
    taken for one that never commits), then was refused.  Now it is refused at once and
    leaves no trace: the reservation stays open, and commits well after the writer's."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)
    with Client(d.endpoint, tenant="acme") as w, Client(d.endpoint, tenant="acme") as v:
        nw, nv = w.namespace(WRITERS), v.namespace(WRITERS)
        keys = nv.keys(range(3 * WRITERS.block_tokens))
        data = [os.urandom(nv.block_bytes) for _ in keys]
        writer = nw.reserve(keys[:1])
        r = nv.reserve(keys)
        assert r.offsets[0] == -1
        bad = p.Commit(v._next_rid(), r.id, [1, 2])
        v._send(bad)
        with pytest.raises(MalformedError, match="2 checksums for 3 blocks"):
            check_reply(v._wait(bad.rid)[0], p.CommitReply)
        dram = _dram(v)
        assert (dram["commits_waited"], dram["commit_wait_timeouts"]) == (0, 0), dram
        writer.buffers[0][:] = data[0]
        assert writer.commit() == 1
        for buf, block, offset in zip(r.buffers, data, r.offsets):
            if offset >= 0:
                buf[:] = block
        assert r.commit() == 2 and r.dropped == 0
        assert nv.get(keys) == data
        dram = settled(v)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_client_pipelining_its_commits_loses_no_block_to_a_cycle_it_ends_itself(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Each of two clients holds two reservations, each one's younger awaiting keys of the
    other's older (as in test_commit_wait_cycles).  The blocking one commits its younger
    first and waits; the asynchronous one sends both its commits at once, younger first.
    Its younger's commit was taken to close a cycle, as if its session were blocked, and
    went on at once, dropping its own block after the keys awaited; its older's commit,
    right behind, had ended the cycle.  Now a cycle is judged once the requests read with
    the commit have run: nothing is dropped, and the bytes read back are the writers'."""
    d = daemon_factory(dram_capacity="16MiB")
    bt = WRITERS.block_tokens
    with Client(d.endpoint, tenant="acme") as c2, ThreadPoolExecutor(1) as pool:
        ns2 = c2.namespace(WRITERS)
        x, y = ns2.keys(range(3 * bt)), ns2.keys(range(1000 * bt, 1003 * bt))
        data = {k: os.urandom(ns2.block_bytes) for k in x + y}

        async def pipelined() -> tuple[list[int], list[int]]:
            async with AsyncClient(d.endpoint, tenant="acme") as c1:
                ns1 = await c1.namespace(WRITERS)
                older1 = written(await ns1.reserve(x[:2]), data)
                older2 = written(ns2.reserve(y[:2]), data)
                younger1 = written(await ns1.reserve(y), data)
                younger2 = written(ns2.reserve(x), data)
                assert younger1.offsets[:2] == younger2.offsets[:2] == [-1, -1]
                blocking = pool.submit(
                    lambda: [younger2.commit(), younger2.dropped, older2.commit()])
                while (await c1.stats())["tiers"]["dram"].get("commits_waited", 0) < 1:
                    await asyncio.sleep(0.02)
                mine = await asyncio.gather(younger1.commit(), older1.commit())
                return [*mine, younger1.dropped], blocking.result()

        mine, theirs = asyncio.run(pipelined())
        assert mine == [1, 2, 0] and theirs == [1, 0, 2], (mine, theirs)
        assert ns2.get(x + y) == [data[k] for k in x + y]
        dram = settled(c2)
        assert (dram["commit_wait_cycles"], dram["awaited_dropped"]) == (0, 0), dram
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_plan_whose_request_hangs_under_a_key_not_committed_yet_is_told_so(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A token plan's request continues a chain whose last two blocks another session's
    open reservation holds slots for (a save of them under way).  The plan was refused
    as if that parent had been evicted since a lookup, which a client looking again
    would find the same.  Now the error says the parent is not committed yet; the plan
    takes nothing, and once that save is committed, the same plan is admitted."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b:
        na, nb = a.namespace(WRITERS), b.namespace(WRITERS)
        bt = WRITERS.block_tokens
        keys = na.keys(range(4 * bt))
        data = {k: os.urandom(na.block_bytes) for k in keys}
        saving = written(na.reserve(keys[:2]), data)
        plan = [PlanItem(2 * bt, 2 * bt, keys[2:], keys[1])]
        with pytest.raises(NotFoundError, match="not committed yet"):
            nb.reserve_batch(plan)
        dram = _dram(b)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (2, 0), dram
        assert saving.commit() == 2
        result = nb.reserve_batch(plan)
        assert result.admitted, result
        (r,) = result.reservations
        assert written(r, data).commit() == 2
        assert nb.get(keys) == [data[k] for k in keys]
        dram = settled(b)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_commit_whose_awaited_keys_are_all_stored_waits_for_no_other_writer(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """k0 is pending in two writers' reservations (the second, an older client's, took a
    slot for it too), and V's reservation awaits it from both.  The first commits k0,
    which is then held for V: V's commit still waited for the second writer, which never
    commits, the whole bound.  Now a commit left awaiting no key awaits no writer: V's
    commit goes on as soon as k0 is stored, and stores its own block under it."""
    d = daemon_factory(dram_capacity="16MiB", lease=4.0)
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b, \
            Client(d.endpoint, tenant="acme") as v, ThreadPoolExecutor(1) as pool:
        na, nb, nv = (c.namespace(WRITERS) for c in (a, b, v))
        keys = na.keys(range(2 * WRITERS.block_tokens))
        data = {k: os.urandom(na.block_bytes) for k in keys}
        first = written(na.reserve(keys[:1]), data)
        older = p.Reserve(b._next_rid(), nb.id, keys[:1], None, True, False)
        b._send(older)
        second = check_reply(b._wait(older.rid)[0], p.ReserveReply)
        assert min(second.offsets) >= 0  # (a slot of its own)
        r = written(nv.reserve(keys), data)
        assert r.offsets[0] == -1
        done = pool.submit(r.commit)
        while _dram(a).get("commits_waited", 0) < 1:
            time.sleep(0.02)
        assert first.commit() == 1
        assert (done.result(), r.dropped) == (1, 0)
        assert nv.get(keys) == [data[k] for k in keys]
        dram = _dram(v)
        assert (dram["commit_wait_timeouts"], dram["awaited_dropped"]) == (0, 0), dram
        abort = p.Abort(b._next_rid(), second.reservation)
        b._send(abort)
        check_reply(b._wait(abort.rid)[0], p.OkReply)
        dram = settled(v)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram


def test_a_namespace_owner_holding_a_reservation_open_stalls_a_grantee_once(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A writer grantee (``auth.shared_writers``) awaits the namespace owner's open
    reservations.  An owner session holding one open, renewing its lease, made every
    commit of the grantee's saving that prefix wait out the bound and drop its blocks.
    Now the grantee's commit waits out the bound once; its next reserve takes a slot."""
    d, token = tenants_daemon(daemon_factory, tmp_path, "16MiB",
                              auth='[auth.shared_writers]\npublic = ["acme"]\n', lease=4.0)

    def connect(tenant: str) -> Client:
        return Client(d.endpoint, token=token(tenant))

    public = make_identity(tenant="public", model="commit-wait-attacks", num_kv_heads=8,
                           head_dim=128)
    with connect("public") as owner, connect("acme") as grantee, connect("ops") as ops:
        mine, theirs = owner.namespace(public), grantee.namespace(public)
        keys = mine.keys(range(3 * public.block_tokens))
        data = {k: os.urandom(mine.block_bytes) for k in keys}
        held_open = mine.reserve(keys[:1])
        first = theirs.reserve(keys)
        assert first.offsets[0] == -1
        assert first.commit() == 0 and first.dropped == 3  # (the bound, once)
        owner.ping()
        again = written(theirs.reserve(keys), data)
        assert min(again.offsets) >= 0, again.offsets
        assert again.commit() == 3 and again.dropped == 0
        assert theirs.get(keys) == [data[k] for k in keys]
        held_open.abort()
        dram = settled(ops)
        assert (dram["commits_waited"], dram["commit_wait_timeouts"]) == (1, 1), dram
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram
