"""Write-through into a remote store that refuses values (Redis at its maxmemory under
noeviction answers each SET with an OOM error, and stays healthy).

A refused write was dropped: the block stayed in DRAM with no remote copy, and nothing
sent it again once the store had room, so another daemon sharing the store never found
it.  Now refused blocks join those an outage held back (``deferred_writes``, bounded by
``DEFERRED_MOST``, the oldest past it counted in ``unsent_writes``), sent again with a
commit once the store has refused nothing for ``remote.unhealthy_seconds``: a full
store is tried again once a cooldown, not by every commit.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
ENV = {"KVSTORE_REMOTE_UNHEALTHY_SECONDS": "0.5"}


def content(key: bytes) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (IDENT.block_bytes // 32 + 1))[:IDENT.block_bytes]


def remote(client: Client) -> dict[str, Any]:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    out: dict[str, Any] = stats["remote"]
    return out


def put_refused(client: Client, ns: Any, redis: RedisServer) -> list[bytes]:
    """Four blocks put while the store is full (every value refused), once the daemon
    counts their writes refused: their keys."""
    with redis.client() as r:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", "1")
    refused = ns.keys(range(4 * IDENT.block_tokens))
    ns.put(refused, [content(k) for k in refused])
    deadline = time.monotonic() + 20
    while remote(client)["refused_writes"] < 4:
        assert time.monotonic() < deadline, remote(client)
        time.sleep(0.05)
    return refused


def test_writes_a_full_redis_refused_are_sent_once_it_has_room(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    a = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env=ENV)
    b = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env=ENV)
    with Client(a.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        refused = put_refused(client, ns, fresh_redis_server)
        during = remote(client)
        assert during["writes"] == 0 and during["deferred_writes"] >= 4, during
        with fresh_redis_server.client() as r:
            r.config_set("maxmemory", "0")  # room again
        # later commits (one a while, as an engine's) send them once the cooldown is over
        puts = 0
        deadline = time.monotonic() + 20
        while remote(client)["writes"] < 4 + puts:
            assert time.monotonic() < deadline, remote(client)
            puts += 1
            more = ns.keys(range(puts * 10**6, puts * 10**6 + IDENT.block_tokens))
            ns.put(more, [content(k) for k in more])
            time.sleep(0.2)
        after = remote(client)
        assert after["unsent_writes"] == 0 and after["refused_writes"] == 4, after
    with Client(b.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        hit = ns.lookup(refused)
        assert hit.blocks == 4 and set(hit.tiers) == {"remote"}
        assert ns.get(refused) == [content(k) for k in refused]


def test_refused_writes_dram_let_go_meanwhile_are_sent_from_their_ssd_copies(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Refused blocks were sent again only while DRAM held them: one DRAM let go to the
    SSD tier before the store had room never got a remote copy.  Now its SSD copy goes."""
    extra = ["--remote", fresh_redis_server.url, "--log-level", "error",
             "--slab-size", "1MiB"]
    a = daemon_factory(dram_capacity="2MiB", ssd_capacity="16MiB", extra=extra, env=ENV)
    b = daemon_factory(extra=extra, env=ENV)
    with Client(a.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        refused = put_refused(client, ns, fresh_redis_server)
        # 48 blocks more through a DRAM of 32: the refused ones go to the SSD tier
        for chain in range(1, 4):
            more = ns.keys(range(chain * 10**6, chain * 10**6 + 16 * IDENT.block_tokens))
            ns.put(more, [content(k) for k in more])
        hit = ns.lookup(refused)
        assert hit.blocks == 4 and set(hit.tiers) == {"ssd"}, hit
        with fresh_redis_server.client() as r:
            r.config_set("maxmemory", "0")  # room again
        puts = 0
        deadline = time.monotonic() + 20
        while remote(client)["writes"] < 4 + 48 + puts:
            assert time.monotonic() < deadline, remote(client)
            puts += 1
            more = ns.keys(range(puts * 10**8, puts * 10**8 + IDENT.block_tokens))
            ns.put(more, [content(k) for k in more])
            time.sleep(0.2)
        assert remote(client)["write_backs"] == 0
    with Client(b.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        hit = ns.lookup(refused)
        assert hit.blocks == 4 and set(hit.tiers) == {"remote"}, hit
        assert ns.get(refused) == [content(k) for k in refused]


def test_refused_writes_go_once_the_store_has_room_with_no_later_commit(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Held writes went only with a later commit: a host whose engine had stopped
    committing (the end of a burst) never sent them, and another daemon sharing the store
    never found them.  Now the generation watch's next check sends them."""
    env = {**ENV, "KVSTORE_REMOTE_CHECK_SECONDS": "0.2"}
    a = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env=env)
    b = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env=env)
    with Client(a.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        refused = put_refused(client, ns, fresh_redis_server)
        with fresh_redis_server.client() as r:
            r.config_set("maxmemory", "0")  # room again; nothing more is committed
        deadline = time.monotonic() + 20
        while remote(client)["writes"] < 4:
            assert time.monotonic() < deadline, remote(client)
            time.sleep(0.1)
        after = remote(client)
        assert after["writes"] == 4 and after["refused_writes"] == 4, after
    with Client(b.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        hit = ns.lookup(refused)
        assert hit.blocks == 4 and set(hit.tiers) == {"remote"}
        assert ns.get(refused) == [content(k) for k in refused]
