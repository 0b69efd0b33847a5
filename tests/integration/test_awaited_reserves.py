"""Two clients saving the same uncommitted blocks at once (real daemon process): the
second's reserve gives the keys the first holds slots for none (offset -1, as a key
held already), so with DRAM full only the first's slots evict anything; the second
copies nothing for them and its commit finds them cached (duplicates).  Where the first
aborts instead, the second's commit stores none of them nor the keys after them
(``dropped``): a later miss, never a block without its parent.  A commit before the
first writer's waits for it (tests/integration/test_commit_waits.py).  An older client's
reserve (no ``skip_held``) still takes a slot for every key."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore import protocol as p
from kvstore.client_wire import check_reply
from kvstore.integrations.engine_side import store_missing

# 128 KiB blocks: a 16 MiB arena holds 128 of them
IDENTITY = make_identity(model="awaited-reserves", num_kv_heads=8, head_dim=128)
CAPACITY = "16MiB"
SLOTS = 128
HALF = SLOTS // 2
SHARED, OWN = 8, 4  # keys both write, keys only the second writes after them


def _dram(c: Client) -> dict[str, Any]:
    tier: dict[str, Any] = c.stats()["tiers"]["dram"]
    return tier


def _full(c: Client, ns: Any) -> None:
    """DRAM full of two cold chains of HALF blocks each."""
    bt = IDENTITY.block_tokens
    for first in (10_000, 20_000):
        keys = ns.keys(range(first * bt, (first + HALF) * bt))
        assert ns.put(keys, [os.urandom(ns.block_bytes) for _ in keys]) == HALF
    assert _dram(c)["free"] == 0


def _chain(ns: Any) -> list[bytes]:
    keys: list[bytes] = ns.keys(range((SHARED + OWN) * IDENTITY.block_tokens))
    return keys


def test_the_second_writer_takes_no_slot_for_pending_keys_in_a_full_dram(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        _full(c1, ns1)
        keys = _chain(ns1)
        first = ns1.reserve(keys[:SHARED])
        second = ns2.reserve(keys)  # both reservations open at once
        assert min(first.offsets) >= 0
        assert second.offsets[:SHARED] == [-1] * SHARED and min(second.offsets[SHARED:]) >= 0
        dram = _dram(c1)
        assert dram["reserved_slots"] == SHARED + OWN, dram
        assert dram["evictions"] == SHARED + OWN, dram  # not 2 * SHARED + OWN
        assert dram["awaited"] == SHARED, dram
        ours = [os.urandom(ns1.block_bytes) for _ in keys]
        for buf, data in zip(first.buffers, ours):
            buf[:] = data
        for buf, data in zip(second.buffers[SHARED:], ours[SHARED:]):
            buf[:] = data
        assert first.commit() == SHARED
        assert second.commit() == OWN and second.dropped == 0
        dram = _dram(c2)
        assert dram["duplicates"] == SHARED and dram["commits"] == SLOTS + SHARED + OWN
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram
        assert ns2.get(keys) == ours


def test_the_first_writer_aborts_the_second_stores_nothing_from_the_gap_on(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        keys = _chain(ns1)
        first = ns1.reserve(keys[:SHARED])
        second = ns2.reserve(keys)
        first.abort()
        for buf in second.buffers:
            buf[:] = os.urandom(ns2.block_bytes)
        assert second.commit() == 0 and second.dropped == SHARED + OWN
        assert ns2.lookup(keys).blocks == 0
        dram = _dram(c2)
        assert dram["awaited_dropped"] == SHARED + OWN, dram
        assert (dram["reserved_slots"], dram["committed_slots"]) == (0, 0), dram


def _waiting(c: Client, commits: int) -> None:
    """Until ``commits`` commits have waited for older writers (a commit's wait begins
    in the daemon after it was sent: polled, within a bound)."""
    deadline = time.monotonic() + 20
    while _dram(c).get("commits_waited", 0) < commits:
        assert time.monotonic() < deadline, _dram(c)
        time.sleep(0.02)


def test_an_engine_save_beside_an_open_writer_reports_what_is_stored(
        daemon_factory: Any) -> None:
    """``store_missing`` copies nothing for the other writer's keys; its commit waits
    for that writer's, then stores its own blocks under them: ``present`` says all."""
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        keys = _chain(ns1)
        first = ns1.reserve(keys[:SHARED])
        calls: list[tuple[int, int]] = []

        def fill(slots: Any, start: int) -> None:
            calls.append((start, len(slots)))

        with ThreadPoolExecutor(1) as pool:
            save = pool.submit(store_missing, ns2, keys, fill, lookup=False)
            _waiting(c1, 1)
            first.commit()
            stored = save.result(timeout=30)
        assert calls == [(SHARED, OWN)]
        assert (stored.present, stored.created, stored.error) == (SHARED + OWN, OWN, None)
        assert ns1.lookup(keys).blocks == SHARED + OWN


def test_the_async_client_and_an_older_client_beside_an_open_writer(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        keys = _chain(ns)
        first = ns.reserve(keys[:SHARED])
        older = check_reply(c._call(p.Reserve(c._next_rid(), ns.id, keys, None))[0],
                            p.ReserveReply)
        assert min(older.offsets) >= 0  # no skip_held: a slot for every key, as before

        async def second() -> tuple[list[int], int, int]:
            async with AsyncClient(d.endpoint, tenant="acme") as ac:
                ans = await ac.namespace(IDENTITY)
                async with ans.reserve(keys) as r:
                    return r.offsets, await r.commit(), r.dropped

        with ThreadPoolExecutor(1) as pool:
            waits = pool.submit(asyncio.run, second())
            _waiting(c, 1)
            first.commit()  # (the older client's reservation, still open, holds all)
            assert not waits.done()
            done = check_reply(c._call(p.Commit(c._next_rid(), older.reservation))[0],
                               p.CommitReply)
            offsets, created, dropped = waits.result(timeout=30)
        assert (done.created, done.duplicates, done.dropped) == (OWN, SHARED, 0)
        # (the older client's reservation held slots for all: awaited too)
        assert offsets == [-1] * (SHARED + OWN) and (created, dropped) == (0, 0)
        dram = _dram(c)
        assert dram["duplicates"] == SHARED + OWN + SHARED, dram
        assert (dram["reserved_slots"], dram["committed_slots"]) == (0, SHARED + OWN), dram
        assert dram["pinned_blocks"] == 0, dram
