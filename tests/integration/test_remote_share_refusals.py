"""A write-back the tenant's share of the remote store refused is no damage: a real
daemon over a real redis-server, ``remote.max_bytes_per_tenant`` smaller than a block.

Measured before: each block DRAM evicted went to the remote store first, the share
refused it (``put_in_share`` answers None for a value refused for the share), and the
write-back read None as "its bytes changed since the commit": the DRAM copy was dropped
with the subtree below it, no copy left anywhere: 24 of 40 blocks lost, none counted as
dropped on eviction.  Now a refused block stays in DRAM, and write-backs skip the store
for a cooldown (as when the store itself refuses values): blocks leave as they would
without a remote store, each counted (no lower tier here: dropped on eviction).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB


def content(key: bytes) -> bytes:
    return (hashlib.blake2b(key, digest_size=32).digest() * (IDENT.block_bytes // 32 + 1))[
        : IDENT.block_bytes]


def test_a_write_back_the_share_refuses_loses_no_block(
        fresh_redis_server: RedisServer, daemon_factory: Any) -> None:
    d = daemon_factory(
        extra=["--remote", fresh_redis_server.url, "--slab-size", str(16 * IDENT.block_bytes),
               "--remote-write-policy", "write-back", "--log-level", "error"],
        dram_capacity=str(16 * IDENT.block_bytes),
        env={"KVSTORE_REMOTE_MAX_BYTES_PER_TENANT": str(IDENT.block_bytes // 2)})
    chains = []
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        for i in range(10):                                       # 40 blocks, DRAM holds 16
            keys = ns.keys(range(1000 * i, 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
            chains.append(keys)
        stats = client.stats()
        dram, shares = stats["tiers"]["dram"], stats["remote_tenants"]["acme"]
        assert stats["remote"]["writes"] == 0 and shares["share_refused"] > 0, shares
        assert stats["invariant_violations"] == 0
        cached = [ns.lookup(keys).blocks for keys in chains]
        # each block is cached still, or left as an eviction without a remote store
        # would (no lower tier here): counted so (before: 24 dropped, 0 counted)
        assert sum(cached) + dram["dropped_on_eviction"] == 40, (cached, dram)
        for keys, n in zip(chains, cached):
            assert ns.get(keys[:n]) == [content(k) for k in keys[:n]]


BIG = make_identity(num_layers=32, num_kv_heads=4, head_dim=64, tenant="mallory")  # 512 KiB
SMALL = make_identity(num_layers=1, num_kv_heads=4, head_dim=64, tenant="alice")   # 16 KiB


def test_a_tenant_past_its_share_leaves_the_others_write_backs_going(
        fresh_redis_server: RedisServer, daemon_factory: Any) -> None:
    """mallory's blocks are larger than a tenant's share (256 KiB), so the share refuses
    each of her write-backs; alice's, of small blocks, fit.  Before, one refusal for
    mallory's share turned write-backs off for every tenant for the cooldown: alice's
    blocks DRAM evicted meanwhile were dropped, none written (0 bytes of hers in the
    store); now only mallory's write-backs skip the store."""
    d = daemon_factory(
        extra=["--remote", fresh_redis_server.url, "--slab-size", str(BIG.block_bytes),
               "--remote-write-policy", "write-back", "--log-level", "error"],
        dram_capacity=str(8 * BIG.block_bytes),
        env={"KVSTORE_REMOTE_MAX_BYTES_PER_TENANT": str(BIG.block_bytes // 2),
             "KVSTORE_REMOTE_UNHEALTHY_SECONDS": "120"})
    with Client(d.endpoint, tenant="mallory") as mallory, \
            Client(d.endpoint, tenant="alice") as alice:
        big = mallory.namespace(BIG)
        for i in range(4):                                   # 12 blocks, DRAM holds 8
            keys = big.keys(range(1000 * i, 1000 * i + 16 * 3))
            big.put(keys, [os.urandom(BIG.block_bytes) for _ in keys])
        refused = mallory.stats()["remote_tenants"]["mallory"]["share_refused"]
        assert refused > 0
        small = alice.namespace(SMALL)
        chains = []
        for i in range(48):                                  # 384 blocks, 6 MiB
            keys = small.keys(range(1000 * i, 1000 * i + 16 * 8))
            small.put(keys, [os.urandom(SMALL.block_bytes) for _ in keys])
            chains.append(keys)
        stats = alice.stats()
        assert stats["tiers"]["dram"]["evictions"] > 0, stats["tiers"]["dram"]
        mine = stats["remote_tenants"].get("alice", {})
        assert mine.get("bytes", 0) > 0 and mine.get("share_refused", 0) == 0, (
            "alice's write-backs skipped the store for mallory's share", mine)
        assert stats["invariant_violations"] == 0
