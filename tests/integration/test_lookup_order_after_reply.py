"""A lookup's reply leaves before the eviction orders hear of its hits
(``Index.lookup(later=True)``, settled once the reply is sent): against the real
daemon, every later request still finds the orders as if they had heard at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client

SMALL = make_identity(num_layers=2, num_kv_heads=2, head_dim=64)  # 16 KiB blocks
CHAINS = 4  # the DRAM tier holds this many 16-block chains (1 MiB), and no more
BLOCKS = 16


def _chain(ns: Any, i: int) -> list[bytes]:
    return ns.keys(range(1000 * i, 1000 * i + BLOCKS * 16))  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_a_looked_up_chain_outlives_the_chains_not_looked_up(
        daemon_factory: Any, tmp_path: Path, policy: str) -> None:
    # (without the daemon's checks after each request: the store's own, which asks that
    # no lookup's hits are left untold, runs in tests/core)
    d = daemon_factory(debug_invariants=False,
                       dram_capacity=str(CHAINS * BLOCKS * SMALL.block_bytes),
                       extra=["--eviction-policy", policy])
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(SMALL)
        blob = bytes(ns.block_bytes)
        for i in range(CHAINS):
            ns.put(_chain(ns, i), [blob] * BLOCKS)
        # the oldest chain, looked up (a hit of all of it), then chains stored until
        # every other chain of the first four went: under LRU it is the warmest of
        # them, and stays; under auto too (every order it duels keeps a chain just hit
        # over ones never hit since they came)
        assert ns.lookup(_chain(ns, 0)).blocks == BLOCKS
        for i in range(CHAINS, 2 * CHAINS - 1):
            ns.put(_chain(ns, i), [blob] * BLOCKS)
            assert ns.lookup(_chain(ns, 0)).blocks == BLOCKS, f"chain 0 evicted at chain {i}"
        assert [ns.lookup(_chain(ns, i)).blocks for i in range(1, CHAINS)] == [0] * 3
