"""Findings of a review of the newest code, each against the real component it is about.

A Redis Cluster's generation: the token lived under one key, so on one primary.  A
primary other than that one that lost what it held (restarted without its data, failed
over to an empty replica) left the token, and so the daemon's marks of the blocks it
held, standing: DRAM dropped those blocks as if Redis held them, and they were lost.
"""

from __future__ import annotations

import asyncio
import secrets

import redis.cluster
from redis_servers import RedisClusterServers

from kvstore.plugins.redis_backend import GENERATION_KEY, RedisBackend


def _node_of(cluster: RedisClusterServers, key: bytes) -> int:
    """The index of the server of ``cluster`` that serves ``key``'s slot."""
    port = cluster.servers[0].port
    with redis.cluster.RedisCluster(host="127.0.0.1", port=port) as client:
        owner = client.get_node_from_key(key)
    return next(i for i, s in enumerate(cluster.servers) if s.port == owner.port)


def _lose_keys(cluster: RedisClusterServers, index: int, prefix: bytes) -> int:
    """What node ``index`` holds under ``prefix``, gone (as that primary coming back
    empty: the test's keys only, the cluster being shared); how many keys that was."""
    gone = 0
    with cluster.servers[index].client() as client:
        for key in list(client.scan_iter(match=prefix + b"*")):
            gone += int(client.delete(key))
    return gone


def test_a_cluster_primary_that_lost_its_keys_changes_the_generation(
        redis_cluster: RedisClusterServers) -> None:
    prefix = f"review54:{secrets.token_hex(4)}:".encode()

    async def run() -> None:
        one = RedisBackend(redis_cluster.url, timeout_s=5.0, key_prefix=prefix.decode())
        other = RedisBackend(redis_cluster.url, timeout_s=5.0, key_prefix=prefix.decode())
        try:
            first = await one.generation()
            assert first, "a token was made"
            assert await one.generation() == first, "the token holds while nothing is lost"
            assert await other.generation() == first, "every daemon of the store sees it"
            # blocks on each primary, then a primary without the first token key loses
            # everything it held
            port = redis_cluster.servers[0].port
            with redis.cluster.RedisCluster(host="127.0.0.1", port=port) as client:
                for i in range(64):
                    client.set(prefix + secrets.token_bytes(32) + bytes([i]), b"block")
            holder = _node_of(redis_cluster, prefix + GENERATION_KEY)
            victim = next(i for i in range(len(redis_cluster.servers)) if i != holder)
            assert _lose_keys(redis_cluster, victim, prefix) >= 1
            lost = await one.generation()
            assert lost and lost != first, (
                "a primary that came back empty is a loss of the store's generation")
            assert await other.generation() == lost
            assert await one.generation() == lost
        finally:
            await one.close()
            await other.close()

    asyncio.run(run())


def test_a_hash_tagged_prefix_keeps_one_token_on_a_cluster(
        redis_cluster: RedisClusterServers) -> None:
    """A prefix with a hash tag puts every key on one slot: one token, no search for
    the others' (there are none)."""
    prefix = f"review54:{{{secrets.token_hex(4)}}}:"

    async def run() -> None:
        backend = RedisBackend(redis_cluster.url, timeout_s=5.0, key_prefix=prefix)
        try:
            first = await backend.generation()
            assert first and await backend.generation() == first
        finally:
            await backend.close()
        port = redis_cluster.servers[0].port
        with redis.cluster.RedisCluster(host="127.0.0.1", port=port) as client:
            assert len(list(client.scan_iter(match=prefix.replace("{", "\\{")
                                             .replace("}", "\\}").encode() + b"*",
                                             target_nodes=client.ALL_NODES))) == 1

    asyncio.run(run())
