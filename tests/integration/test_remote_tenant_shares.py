"""One tenant must not take the whole shared remote store: a real daemon over a real
redis-server at its ``maxmemory``, a tenant writing far more than its share
(``remote.max_bytes_per_tenant``) and another tenant beside it.

Measured before (a 20 MiB Redis, 512 KiB blocks, the flooding tenant writing 192 of
them, 96 MiB): under ``allkeys-lru`` the other tenant's first chain was evicted, 0 of its
4 blocks left in Redis; under ``noeviction`` its chain written after the flood was
refused, 0 of 4 in Redis; the flooding tenant held all the store took (16-17 MiB).
Now the flooder keeps at most its 8 MiB (half of ``remote.capacity = "16MiB"``), its own
oldest values deleted to make room, and both of the other tenant's chains are in Redis
and read back whole by a second daemon.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

PREFIX = b"kvstore:"
CAPACITY = 16 << 20
BOUND = CAPACITY // 2  # remote.max_bytes_per_tenant's default share, 50%
BIG = dict(num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=16)  # 512 KiB blocks
VICTIM = make_identity(tenant="globex", **BIG)
FLOODER = make_identity(tenant="acme", **BIG)
CHAIN = 4
FLOOD_CHAINS = 48


def wait_for(check: Any, what: Any, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


def put_chain(ns: Any, ident: Any, i: int) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(i * 1000, i * 1000 + CHAIN * ident.block_tokens))
    ns.put(keys, [bytes([i % 251]) * ident.block_bytes for _ in keys])
    return keys


def stored(redis: RedisServer, ident: Any, chains: list[list[bytes]]) -> int:
    """How many of the keys of ``chains`` (of ``ident``'s namespace) the server holds."""
    client = redis.client()
    return sum(client.exists(PREFIX + ident.namespace_id + k) for keys in chains for k in keys)


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_flooding_tenant_keeps_within_its_share(
        daemon_factory: Any, fresh_redis_server: RedisServer, policy: str) -> None:
    redis = fresh_redis_server
    redis.client().config_set("maxmemory", str(20 << 20))
    redis.client().config_set("maxmemory-policy", policy)
    env = {"KVSTORE_REMOTE_CAPACITY": "16MiB"}
    d = daemon_factory(extra=["--remote", redis.url], dram_capacity="256MiB", env=env)
    flooded: list[list[bytes]] = []
    with Client(d.endpoint, tenant="globex") as v, Client(d.endpoint, tenant="acme") as a:
        victim, flood = v.namespace(VICTIM), a.namespace(FLOODER)
        mine = [put_chain(victim, VICTIM, 0)]
        wait_for(lambda: v.stats()["remote"]["writes"] >= CHAIN, "the first chain never went")
        for half in range(2):
            for i in range(half * FLOOD_CHAINS // 2, (half + 1) * FLOOD_CHAINS // 2):
                flooded.append(put_chain(flood, FLOODER, i))
            # every one written (its tenant's oldest deleted for room), or refused by a
            # store full of them (before)
            wait_for(lambda: (r := a.stats()["remote"])["writes"] + r["refused_writes"]
                     >= CHAIN * (len(mine) + len(flooded)), lambda: ("the flood was never sent", a.stats()["remote"],
                               a.stats()["remote_tenants"], d.log()[-3000:]))
            assert stored(redis, FLOODER, flooded) * FLOODER.block_bytes <= BOUND
            if half == 0:
                mine.append(put_chain(victim, VICTIM, 1))
        shares = a.stats()["remote_tenants"]
        assert shares["acme"]["bytes"] <= BOUND, shares
        most = BOUND // FLOODER.block_bytes
        assert shares["acme"]["share_deleted"] >= CHAIN * len(flooded) - most, shares
        assert shares["globex"]["bytes"] == 2 * CHAIN * VICTIM.block_bytes, shares
    held = stored(redis, FLOODER, flooded)
    assert 0 < held * FLOODER.block_bytes <= BOUND, held
    assert stored(redis, VICTIM, mine) == 2 * CHAIN
    # read back whole by a daemon that holds nothing of them
    d.stop()
    other = daemon_factory(extra=["--remote", redis.url], env=env)
    with Client(other.endpoint, tenant="globex") as v:
        victim = v.namespace(VICTIM)
        for i, keys in enumerate(mine):
            assert victim.get(keys) == [bytes([i]) * VICTIM.block_bytes] * CHAIN, i
