"""Commits that wait for other writers make no cycle across sessions (real daemon process,
real clients).  Each of two clients holds two reservations, and each one's younger
reservation awaits a key of the other's older one.  Each commits its younger one first:
a blocking client sends its older one's commit only once that reply is back, so each
commit waited for the other client's older reservation, which waited for that reply.
Both waited out the bound (2.5 s), then stored nothing from the awaited key on.  Now the
commit that would close the cycle waits for nothing: it stores what is cached and drops
the rest, its client goes on to commit its older reservation, and that wakes the other
commit, which stores all of its blocks."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtest import commits_waited, make_identity, written

from kvstore import Client

# 128 KiB blocks: a 16 MiB arena holds 128 of them
IDENTITY = make_identity(model="commit-wait-cycles", num_kv_heads=8, head_dim=128)


def _dram(c: Client) -> dict[str, Any]:
    tier: dict[str, Any] = c.stats()["tiers"]["dram"]
    return tier


def test_two_clients_each_committing_its_younger_reservation_first_do_not_stall(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="16MiB")  # (the default lease: a wait's bound 2.5 s)
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        bt = IDENTITY.block_tokens
        x = ns1.keys(range(3 * bt))  # c1's older reservation holds x[:2]
        y = ns1.keys(range(1000 * bt, 1003 * bt))  # c2's older one holds y[:2]
        data = {k: os.urandom(ns1.block_bytes) for k in x + y}
        older1 = written(ns1.reserve(x[:2]), data)
        older2 = written(ns2.reserve(y[:2]), data)
        younger1 = written(ns1.reserve(y), data)  # y[:2] awaited from older2
        younger2 = written(ns2.reserve(x), data)  # x[:2] awaited from older1
        assert younger1.offsets[:2] == [-1, -1] and younger2.offsets[:2] == [-1, -1]

        def client(younger: Any, older: Any) -> tuple[int, int]:
            done = younger.commit()  # (a blocking client: the older one only after)
            return done, older.commit()

        with ThreadPoolExecutor(2) as pool:
            start = time.monotonic()
            first = pool.submit(client, younger1, older1)
            commits_waited(c2, 1)  # younger1 waits for older2
            second = pool.submit(client, younger2, older2)
            results = first.result(timeout=30), second.result(timeout=30)
            took = time.monotonic() - start
        dram = _dram(c1)
        assert dram["commit_wait_timeouts"] == 0, (took, dram)
        # younger2 closed the cycle: x[0] not cached yet, nothing of it stored; then its
        # client committed older2, which woke younger1: all of y stored
        assert results == ((1, 2), (0, 2)), results
        assert (younger1.dropped, younger2.dropped) == (0, 3)
        assert dram["commit_wait_cycles"] == 1 and dram["awaited_dropped"] == 3, dram
        assert (dram["reserved_slots"], dram["pinned_blocks"], dram["blocks"]) == (0, 0, 5)
        assert ns2.get(y) == [data[k] for k in y]
        assert ns2.get(x[:2]) == [data[k] for k in x[:2]]
        assert ns2.lookup(x).blocks == 2
        assert c1.stats()["invariant_violations"] == 0


def test_the_waiter_that_loses_fewer_of_its_own_blocks_goes_on_and_the_closer_waits(
        daemon_factory: Any) -> None:
    """The commit closing the cycle would throw away 3 blocks of its own bytes, the one
    waiting already 1: that one goes on at once (its key awaited is no loss: its writer
    stores it), and the closer waits, then stores all of its blocks."""
    d = daemon_factory(dram_capacity="16MiB")
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        bt = IDENTITY.block_tokens
        x = ns1.keys(range(5 * bt))  # c1's older reservation holds x[:2]
        y = ns1.keys(range(1000 * bt, 1003 * bt))  # c2's older one holds y[:2]
        data = {k: os.urandom(ns1.block_bytes) for k in x + y}
        older1 = written(ns1.reserve(x[:2]), data)
        older2 = written(ns2.reserve(y[:2]), data)
        younger1 = written(ns1.reserve(y), data)  # 1 block of its own after y[:2]
        younger2 = written(ns2.reserve(x), data)  # 3 of its own after x[:2]

        def client(younger: Any, older: Any) -> tuple[int, int]:
            done = younger.commit()
            return done, older.commit()

        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client, younger1, older1)
            commits_waited(c2, 1)
            second = pool.submit(client, younger2, older2)
            results = first.result(timeout=30), second.result(timeout=30)
        assert results == ((0, 2), (3, 2)), results
        assert (younger1.dropped, younger2.dropped) == (3, 0)
        dram = _dram(c1)
        assert (dram["commit_wait_cycles"], dram["commit_wait_timeouts"]) == (1, 0), dram
        assert (dram["commits_waited"], dram["awaited_dropped"]) == (2, 3), dram
        assert (dram["reserved_slots"], dram["pinned_blocks"], dram["blocks"]) == (0, 0, 7)
        assert ns1.get(x) == [data[k] for k in x]
        assert ns1.get(y[:2]) == [data[k] for k in y[:2]] and ns1.lookup(y).blocks == 2
        assert c1.stats()["invariant_violations"] == 0
