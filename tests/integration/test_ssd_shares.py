"""The SSD tier is one for all tenants, and each keeps its share of it: a tenant that
writes far more than the tier holds makes room among its own copies, not another's.

Before, the tier kept one LRU order: a tenant's burst pushed every other tenant's SSD
copies out (they were the oldest), as a shared DRAM tier without shares would.  A real
daemon, two tenants, a burst of eight times the SSD tier from one of them.
"""

from __future__ import annotations

import time
from typing import Any

from kvtest import make_identity

from kvstore import Client

CHAIN = 8


def ident(tenant: str) -> Any:
    return make_identity(tenant=tenant, head_dim=256)  # 64 KiB blocks


def put_chains(ns: Any, first: int, count: int, fill: int) -> list[list[bytes]]:
    chains = []
    for i in range(first, first + count):
        keys = ns.keys(range(i * 1000, i * 1000 + CHAIN * 16))
        ns.put(keys, [bytes([fill, j]) * (ns.block_bytes // 2) for j in range(CHAIN)])
        chains.append(keys)
    return chains


def test_a_tenants_burst_leaves_the_others_ssd_copies(daemon_factory: Any) -> None:
    # 64 blocks of DRAM, 256 of SSD
    d = daemon_factory(dram_capacity="4MiB", ssd_capacity="16MiB")
    with Client(d.endpoint, tenant="quiet") as q, Client(d.endpoint, tenant="loud") as l:
        quiet, loud = q.namespace(ident("quiet")), l.namespace(ident("loud"))
        mine = put_chains(quiet, 0, 12, 1)  # 96 blocks: past DRAM, some on SSD
        before = q.stats()["tiers"]
        assert before["ssd"]["committed_slots"] > 0
        put_chains(loud, 100, 256, 2)  # 2048 blocks: eight times the SSD tier
        stats = q.stats()
        # every block of the quiet tenant is still cached, in DRAM or on SSD, as written
        for j, keys in enumerate(mine):
            assert quiet.lookup(keys).blocks == CHAIN, (j, stats["tiers"])
            assert quiet.get(keys) == [bytes([1, k]) * (quiet.block_bytes // 2)
                                       for k in range(CHAIN)]
        assert stats["ssd_tenant_bytes"]["quiet"] > 0, stats["ssd_tenant_bytes"]
        loud_ssd = stats["ssd_tenant_bytes"]["loud"]
        assert loud_ssd >= 128 * loud.block_bytes, stats["ssd_tenant_bytes"]  # its share
        assert stats["invariant_violations"] == 0


def test_a_tenant_alone_has_the_whole_ssd_tier(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="4MiB", ssd_capacity="16MiB")
    with Client(d.endpoint, tenant="solo") as c:
        ns = c.namespace(ident("solo"))
        chains = put_chains(ns, 0, 80, 3)  # 640 blocks: twice what DRAM and SSD hold
        # (a block that waited for room too long on a loaded machine is dropped, not
        # written down: the tier fills all the same, with twice what it holds offered)
        deadline = time.monotonic() + 10
        while (stats := c.stats())["tiers"]["ssd"]["committed_slots"] < 256:
            assert time.monotonic() < deadline, stats["tiers"]["ssd"]
            time.sleep(0.05)
        assert stats["ssd_tenant_bytes"] == {"solo": 256 * ns.block_bytes}
        # the latest chains are cached whole, the oldest went first (LRU, as before)
        assert ns.lookup(chains[-1]).blocks == CHAIN
        assert ns.lookup(chains[0]).blocks == 0
