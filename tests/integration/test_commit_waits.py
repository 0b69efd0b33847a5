"""A commit waits for the older writers of the keys its reserve gave no slot (real daemon
process, two clients): two engines saving the same prefix, each its own continuation;
the second copies only its own tail and commits first.  Before, that commit found the
shared keys not cached yet and stored none of them nor its own blocks after them (a
later miss); now it waits until the first writer's reservation ends, then stores its own
blocks under the first's (pinned for it at that commit, so no eviction between the two
makes a gap), or, where the first aborted or its lease ran out, stores nothing from the
gap on.  Its session ending or the daemon stopping ends the wait, leaking nothing."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kvtest import commits_waited, make_identity, settled

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError

# 128 KiB blocks: a 16 MiB arena holds 128 of them
IDENTITY = make_identity(model="commit-waits", num_kv_heads=8, head_dim=128)
CAPACITY = "16MiB"
SLOTS = 128
SHARED, OWN = 8, 4  # keys both write, keys only the second writes after them


def _dram(c: Client) -> dict[str, Any]:
    tier: dict[str, Any] = c.stats()["tiers"]["dram"]
    return tier


def _writers(c1: Client, c2: Client) -> tuple[Any, Any, list[bytes], list[bytes]]:
    """The first writer's reservation of the shared keys, the second's of all, and the
    bytes each block is written with."""
    ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
    keys: list[bytes] = ns1.keys(range((SHARED + OWN) * IDENTITY.block_tokens))
    data = [os.urandom(ns1.block_bytes) for _ in keys]
    first = ns1.reserve(keys[:SHARED])
    second = ns2.reserve(keys)
    assert second.offsets[:SHARED] == [-1] * SHARED and min(second.offsets[SHARED:]) >= 0
    for buf, block in zip(first.buffers, data):
        buf[:] = block
    for buf, block in zip(second.buffers[SHARED:], data[SHARED:]):
        buf[:] = block
    return first, second, keys, data


def test_the_second_writer_commits_first_then_the_first_all_blocks_stored(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        first, second, keys, data = _writers(c1, c2)
        with ThreadPoolExecutor(1) as pool:
            commit = pool.submit(second.commit)
            commits_waited(c1)
            assert not commit.done()
            assert first.commit() == SHARED
            assert commit.result(timeout=30) == OWN
        assert second.dropped == 0
        dram = settled(c1)
        assert (dram["commits"], dram["duplicates"], dram["awaited_dropped"]) == (
            SHARED + OWN, SHARED, 0)
        assert dram["commit_wait_timeouts"] == 0
        assert c2.namespace(IDENTITY).get(keys) == data


def test_the_first_writer_aborts_while_the_second_waits(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        first, second, keys, _ = _writers(c1, c2)
        with ThreadPoolExecutor(1) as pool:
            commit = pool.submit(second.commit)
            commits_waited(c1)
            first.abort()
            assert commit.result(timeout=30) == 0
        assert second.dropped == SHARED + OWN  # the gap rule: nothing from it on
        assert c1.namespace(IDENTITY).lookup(keys).blocks == 0
        dram = settled(c1)
        assert (dram["committed_slots"], dram["commit_wait_timeouts"]) == (0, 0), dram


def test_the_first_writers_lease_runs_out_while_the_second_waits(
        daemon_factory: Any) -> None:
    """The first writer's client goes silent: its lease's end rolls it back and wakes the
    waiting commit (before the wait's bound, half a lease from the commit)."""
    lease = 4.0
    d = daemon_factory(dram_capacity=CAPACITY, lease=lease)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        keys = ns1.keys(range((SHARED + OWN) * IDENTITY.block_tokens))
        first = ns1.reserve(keys[:SHARED])
        time.sleep(0.9 * lease)  # c1 silent from here on
        second = ns2.reserve(keys)
        assert second.offsets[:SHARED] == [-1] * SHARED
        assert second.commit() == 0 and second.dropped == SHARED + OWN
        dram = settled(c2)
        assert dram["commits_waited"] == 1 and dram["commit_wait_timeouts"] == 0, dram
        assert dram["lease_expiries"] == 1 and dram["committed_slots"] == 0, dram
        assert ns2.lookup(keys).blocks == 0
        with pytest.raises(KVStoreError):
            first.commit()


def test_the_first_commits_then_pressure_before_the_second_commits_no_gap(
        daemon_factory: Any) -> None:
    """The first writer's blocks are pinned for the second from its commit to the
    second's: before, the pressure between evicted them, and the second's commit found
    a gap and dropped its own blocks."""
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        first, second, keys, data = _writers(c1, c2)
        assert first.commit() == SHARED
        assert _dram(c1)["pinned_blocks"] == SHARED  # for the second writer
        # a third writer puts twice as many blocks as DRAM holds: what is evictable goes
        ns3 = c1.namespace(make_identity(model="pressure", num_kv_heads=8, head_dim=128))
        bt = IDENTITY.block_tokens
        for start in range(0, 2 * SLOTS, 4):
            chunk = ns3.keys(range((10_000 + start) * bt, (10_004 + start) * bt))
            assert ns3.put(chunk, [os.urandom(ns3.block_bytes) for _ in chunk]) == 4
        assert _dram(c1)["evictions"] >= SLOTS
        assert second.commit() == OWN and second.dropped == 0
        assert c2.namespace(IDENTITY).get(keys) == data
        settled(c1)


def test_the_waiting_client_closes_nothing_is_leaked(daemon_factory: Any) -> None:
    """The second writer's client closes (its goodbye ends the session) while its commit
    waits: the reservation rolls back with the session, its wait ends, and the first
    writer's commit pins nothing for it."""
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1:
        ns1 = c1.namespace(IDENTITY)
        keys = ns1.keys(range((SHARED + OWN) * IDENTITY.block_tokens))
        first = ns1.reserve(keys[:SHARED])

        async def second() -> None:
            ac = await AsyncClient(d.endpoint, tenant="acme").connect()
            ans = await ac.namespace(IDENTITY)
            r = await ans.reserve(keys)
            commit = asyncio.ensure_future(r.commit())
            try:
                await asyncio.to_thread(commits_waited, c1)
            finally:
                await ac.close()
                commit.cancel()  # (its reply never comes to a closed client)
                await asyncio.gather(commit, return_exceptions=True)

        asyncio.run(second())
        # (the goodbye goes without a reply: c1's next request may be read before it)
        deadline = time.monotonic() + 10
        while c1.stats()["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        dram = _dram(c1)
        assert dram["reserved_slots"] == SHARED, dram  # the first writer's only
        assert first.commit() == SHARED
        dram = settled(c1)
        assert dram["committed_slots"] == SHARED and dram["commit_wait_timeouts"] == 0
        assert c1.stats()["sessions"] == 1


def test_the_daemon_stops_while_a_commit_waits(daemon_factory: Any) -> None:
    """The stop ends the wait (no writer's commit is read any more): the waiting commit
    is answered by the gap rule, and the daemon's drain does not wait out its bound."""
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        # the first writer's reservation kept, never committed (dropped, the client
        # would give it back at its next call, and the second's commit need not wait)
        first, second, _, _ = _writers(c1, c2)
        with ThreadPoolExecutor(1) as pool:
            commit = pool.submit(second.commit)
            commits_waited(c1)
            assert d.stop() == 0
            assert commit.result(timeout=30) == 0
        assert second.dropped == SHARED + OWN and not first.done
