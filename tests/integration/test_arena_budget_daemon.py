"""Per-tenant arenas draw on one budget of ``dram.capacity``: a real daemon with
credentials, three tenants each writing more than half the capacity; what the arenas
commit, and the memory their files hold, stays within the capacity.  A sparse arena's
memory follows its slabs; the metrics show each arena's slabs and the budget."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from kvtest import arena_memory, make_identity, tenants_daemon

from kvstore.client import Client
from kvstore.keys import chain_keys
from kvstore.metrics import Metrics
from kvstore.tiers.dram import DramArena

CAPACITY = 32 << 20
SLAB = 1 << 20


def test_three_tenants_writing_more_than_half_the_capacity_each_stay_within_it(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "32MiB",
                              'slab_size = "1MiB"\narena_kind = "memfd"\n')
    assert d.proc is not None
    clients = {t: Client(d.endpoint, token=token(t))
               for t in ("a", "b", "c")}
    ops = Client(d.endpoint, token=token("ops"))  # (the whole daemon's)
    try:
        spaces = {t: c.namespace(make_identity(tenant=t, head_dim=128))  # 32 KiB blocks
                  for t, c in clients.items()}
        block = spaces["a"].identity.block_bytes
        per_put = 32
        puts = CAPACITY * 3 // 4 // (block * per_put)  # 24 MiB each: more than half
        worst_committed = worst_memory = 0
        for t, ns in spaces.items():  # one after the other: b, c take a's slabs
            for i in range(puts):
                keys = [chain_keys(ns.id, list(range(n * 16, n * 16 + 16)), 16)[0]
                        for n in range(i * per_put, (i + 1) * per_put)]
                ns.put(keys, [bytes([n % 251]) * block for n in range(per_put)])
                dram = ops.stats()["tiers"]["dram"]
                worst_committed = max(worst_committed, dram["committed"])
                worst_memory = max(worst_memory, arena_memory(d.proc.pid))
        assert worst_committed <= CAPACITY, worst_committed
        assert worst_memory <= CAPACITY, worst_memory
        stats = ops.stats()
        dram = stats["tiers"]["dram"]
        assert dram["budget_slabs"] == CAPACITY // SLAB
        assert dram["allocated"] <= CAPACITY
        assert dram["budget_taken"] > 0  # b and c took slabs a had filled first
        # each tenant sees its own arena's slabs, about a third of the budget each
        held = {t: sum(c["slabs"] for c in clients[t].stats()["slab_classes"]["dram"])
                for t in clients}
        assert sum(held.values()) <= CAPACITY // SLAB
        assert all(n >= CAPACITY // SLAB // 3 - 1 for n in held.values()), held
        for t, ns in spaces.items():  # the latest writes of each are there and read back
            keys = [chain_keys(ns.id, list(range(n * 16, n * 16 + 16)), 16)[0]
                    for n in range((puts - 1) * per_put, puts * per_put)]
            assert ns.get(keys) == [bytes([n % 251]) * block for n in range(per_put)]
        assert stats["invariant_violations"] == 0
    finally:
        for c in [*clients.values(), ops]:
            c.close()


def test_a_sparse_arena_takes_memory_as_written_and_gives_a_released_slab_back() -> None:
    arena = DramArena(4 * SLAB, memfd=True, sparse=True)
    try:
        assert arena.allocated_bytes() == 0  # (a full arena: all of it from the start)
        arena.slot(SLAB, SLAB)[:] = b"\x07" * SLAB
        arena.slot(2 * SLAB, 4096)[:] = b"\x08" * 4096
        assert arena.allocated_bytes() == SLAB + 4096
        arena.release(SLAB, SLAB)  # the slab back to the budget: its memory goes
        assert arena.allocated_bytes() == 4096
        assert bytes(arena.slot(2 * SLAB, 4096)) == b"\x08" * 4096  # the others kept
    finally:
        arena.close()
    full = DramArena(4 * SLAB, memfd=True, populate=False)
    try:
        assert full.allocated_bytes() == 4 * SLAB
    finally:
        full.close()


def test_the_metrics_show_each_arenas_slabs_and_the_budget() -> None:
    stats = {"tiers": {"dram": {"empty_slabs": 3, "budget_slabs": 32, "allocated": 7 << 20,
                                "budget_taken": 5, "budget_no_memory": 2,
                                "budget_held_back": 9}},
             "slab_classes": {"dram": [
                 {"arena": "a", "slot_bytes": 32768, "slabs": 20, "share": 20.0},
                 {"arena": "a", "slot_bytes": 16384, "slabs": 4, "share": 4.0},
                 {"arena": "b", "slot_bytes": 32768, "slabs": 5, "share": 5.0}], "ssd": []}}
    text = Metrics(lambda: stats).exposition().decode()
    assert 'kvstore_arena_slabs{arena="a"} 24.0' in text
    assert 'kvstore_arena_slabs{arena="b"} 5.0' in text
    assert 'kvstore_pool_budget_slabs{tier="dram"} 32.0' in text
    assert 'kvstore_pool_empty_slabs{tier="dram"} 3.0' in text
    assert 'kvstore_pool_allocated_bytes{tier="dram"} 7.340032e+06' in text
    assert 'kvstore_budget_slabs_taken_total{tier="dram"} 5.0' in text
    assert 'kvstore_budget_slabs_without_memory_total{tier="dram"} 2.0' in text
    assert 'kvstore_budget_refusals_total{tier="dram"} 9.0' in text
