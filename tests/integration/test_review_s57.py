"""Second reading of the commits that wait for other writers and of the slab budget over
per-tenant arenas, against real daemons: the cases that failed, kept."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore.client import Client
from kvstore.keys import chain_keys


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
