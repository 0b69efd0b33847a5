"""Tenants of per-tenant arenas under one budget, at random and at once (real daemon
process with credentials, four tenants on threads of their own, two block sizes each):
puts of chains, reads back, reservations aborted, evictions, while slabs pass between the
arenas (a tenant below its share takes one from the arena furthest over it) and between
a tenant's block sizes.  What must hold whatever the interleaving: every block read
back has the bytes its key was written with, what the arenas commit and the memory
their files hold stay within ``dram.capacity``, the budget is never overdrawn, and once
the tenants are done nothing is left reserved or pinned."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import arena_memory, key_bytes, make_identity, misread, settled, tenants_daemon

from kvstore.client import Client
from kvstore.errors import KVStoreError, LimitExceededError

CAPACITY = 16 << 20
TENANTS = ("a", "b", "c", "d")
STEPS = 150


def tenant_run(endpoint: str, token: str, tenant: str, seed: int, late: float,
               out: dict[str, Any]) -> None:
    """``late``: seconds before its first request (the first comers fill the budget,
    the later ones take slabs from them)."""
    rng = random.Random(seed)
    time.sleep(late)
    wrong: list[bytes] = []
    refused = 0
    with Client(endpoint, token=token) as c:
        spaces = [c.namespace(make_identity(tenant=tenant, head_dim=h))  # 8 and 32 KiB
                  for h in (32, 128)]
        for _ in range(STEPS):
            ns = rng.choice(spaces)
            size = ns.block_bytes
            first = rng.randrange(80) * 1000
            tokens = list(range(first, first + rng.randint(1, 12) * ns.identity.block_tokens))
            keys = ns.keys(tokens)
            op = rng.random()
            try:
                if op < 0.5:
                    ns.put(keys, [key_bytes(k, size) for k in keys])
                elif op < 0.6:
                    with ns.reserve(keys) as r:  # left: aborted
                        for buf, key in zip(r.buffers, keys):
                            buf[:] = key_bytes(key, size)
                elif op < 0.7:
                    ns.evict(keys[-3:])
                else:
                    wrong += misread(ns, keys)
            except LimitExceededError:
                refused += 1  # (no room at that moment: refused whole, nothing written)
    out[tenant] = (wrong, refused)


@pytest.mark.parametrize("seed", [1, 2])
def test_tenants_at_once_read_their_own_bytes_within_the_budget(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, seed: int) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "16MiB",
                              'slab_size = "1MiB"\narena_kind = "memfd"\n')
    assert d.proc is not None
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(i: int, tenant: str) -> None:
        try:
            tenant_run(d.endpoint, token(tenant), tenant,
                       seed * 10 + i, 0.4 * i, out)
        except (KVStoreError, AssertionError) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(TENANTS)]
    worst_committed = worst_memory = 0
    with Client(d.endpoint, token=token("ops")) as ops:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            dram = ops.stats()["tiers"]["dram"]
            worst_committed = max(worst_committed, dram["committed"])
            worst_memory = max(worst_memory, arena_memory(d.proc.pid))
            time.sleep(0.01)
        for t in threads:
            t.join()
        assert not errors, errors
        dram = settled(ops)
    assert worst_committed <= CAPACITY, worst_committed
    assert worst_memory <= CAPACITY, worst_memory
    assert dram["allocated"] <= CAPACITY
    assert dram["budget_taken"] > 0  # the later tenants took slabs of the first ones
    assert {t: out[t][0] for t in TENANTS} == {t: [] for t in TENANTS}
    # the tenants were served: most of their writes went in
    assert sum(out[t][1] for t in TENANTS) < len(TENANTS) * STEPS // 4, out
