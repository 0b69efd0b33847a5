"""The remote tier in the real daemon: two daemons sharing one real Redis (and a cluster)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisClusterServers, RedisServer

from kvstore import Client
from kvstore.errors import KVStoreError, NotFoundError, UnavailableError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB


def content(key: bytes) -> bytes:
    import hashlib

    return (hashlib.blake2b(key, digest_size=32).digest() * (IDENT.block_bytes // 32 + 1))[
        : IDENT.block_bytes]


def remote_stats(client: Client) -> dict[str, Any]:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    r: dict[str, Any] = stats["remote"]
    return r


def wait_for(predicate: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def share_through(url: str, factory: Any, tokens: int) -> tuple[Any, Any]:
    a = factory(remote=url)
    b = factory(remote=url)
    with Client(a.endpoint, tenant="acme") as ca:
        ns = ca.namespace(IDENT)
        keys = ns.keys(range(tokens, tokens + 16 * 6))
        ns.put(keys, [content(k) for k in keys])
        wait_for(lambda: remote_stats(ca)["writes"] >= 6, "write-through to the remote")
    with Client(b.endpoint, tenant="acme") as cb:
        ns = cb.namespace(IDENT)
        keys = ns.keys(range(tokens, tokens + 16 * 6))
        hit = ns.lookup(keys)
        assert hit.blocks == 6 and set(hit.tiers) == {"remote"}
        assert ns.get(keys) == [content(k) for k in keys]        # fetched into B's DRAM
        assert ns.lookup(keys).tiers == ["dram"] * 6
        other = cb.namespace(make_identity(num_layers=4, num_kv_heads=4, head_dim=64,
                                           tenant="acme", model_revision="r2"))
        assert other.lookup(other.keys(range(tokens, tokens + 16 * 6))).blocks == 0
        assert remote_stats(cb)["reads"] == 6
    return a, b


@pytest.fixture
def remote_daemon_factory(daemon_factory: Any) -> Any:
    def start(remote: str, **kw: Any) -> Any:
        extra = kw.pop("extra", [])
        return daemon_factory(extra=["--remote", remote, *extra], **kw)
    return start


def test_a_block_offloaded_through_one_daemon_reloads_through_another(
        redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    share_through(redis_server.url, remote_daemon_factory, 1_000_000)


def test_sharing_through_a_redis_cluster(redis_cluster: RedisClusterServers,
                                         remote_daemon_factory: Any) -> None:
    share_through(redis_cluster.url, remote_daemon_factory, 2_000_000)


def test_redis_down_and_back(fresh_redis_server: RedisServer,
                             remote_daemon_factory: Any) -> None:
    d = remote_daemon_factory(fresh_redis_server.url,
                              extra=["--log-level", "error"])
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        first = ns.keys(range(16 * 4))
        ns.put(first, [content(k) for k in first])
        wait_for(lambda: remote_stats(client)["writes"] >= 4, "the first writes")
        fresh_redis_server.kill()
        started = time.monotonic()
        more = ns.keys(range(50_000, 50_000 + 16 * 4))
        ns.put(more, [content(k) for k in more])                  # local tiers keep serving
        unknown = ns.keys(range(90_000, 90_000 + 16 * 4))
        assert ns.lookup(unknown).blocks == 0                     # bounded by the timeout
        with pytest.raises(NotFoundError):
            ns.get(unknown)
        assert time.monotonic() - started < 8, "a request waited past the remote's timeout"
        assert ns.get(first) == [content(k) for k in first]       # local data intact
        wait_for(lambda: remote_stats(client)["errors"] >= 1, "the error count")
        assert remote_stats(client)["healthy"] is False
        fresh_redis_server.start()
        wait_for(lambda: remote_stats(client)["healthy"], "recovery", timeout=20)
        again = ns.keys(range(70_000, 70_000 + 16 * 2))
        ns.put(again, [content(k) for k in again])
        wait_for(lambda: remote_stats(client)["writes"] >= 6, "writes after recovery")


def test_a_corrupt_remote_value_is_a_miss(redis_server: RedisServer,
                                          remote_daemon_factory: Any) -> None:
    a = remote_daemon_factory(redis_server.url)
    b = remote_daemon_factory(redis_server.url)
    with Client(a.endpoint, tenant="acme") as ca:
        ns = ca.namespace(IDENT)
        keys = ns.keys(range(3_000_000, 3_000_000 + 16 * 2))
        ns.put(keys, [content(k) for k in keys])
        wait_for(lambda: remote_stats(ca)["writes"] >= 2, "write-through")
    with redis_server.client() as r:
        stored = [k for k in r.scan_iter() if keys[1] in k]
        assert len(stored) == 1
        value = bytearray(r.get(stored[0]))
        value[-5] ^= 0xFF
        r.set(stored[0], bytes(value))
    with Client(b.endpoint, tenant="acme") as cb:
        ns = cb.namespace(IDENT)
        with pytest.raises(NotFoundError):
            ns.get(keys)
        assert remote_stats(cb)["corrupt_values"] >= 1
        assert ns.get(keys[:1]) == [content(keys[0])]             # the good prefix still comes
        assert cb.stats()["tiers"]["dram"]["reserved_slots"] == 0


def test_write_back_writes_only_what_dram_evicts_and_loses_nothing(
        redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """DRAM holds 16 blocks.  Write-back sends a block to Redis only when DRAM evicts it;
    every block put comes back (from Redis once evicted), and a clean stop writes back
    what is left, so another daemon finds all of it."""
    a = remote_daemon_factory(redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              extra=["--slab-size", str(16 * IDENT.block_bytes),
                                     "--remote-write-policy", "write-back"])
    chains = []
    with Client(a.endpoint, tenant="acme") as ca:
        ns = ca.namespace(IDENT)
        for i in range(10):                                       # 40 blocks
            keys = ns.keys(range(4_000_000 + 1000 * i, 4_000_000 + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
            chains.append(keys)
        r = remote_stats(ca)
        assert 24 <= r["write_backs"] == r["writes"] < 40        # the evicted ones only
        assert ca.stats()["tiers"]["dram"]["dropped_on_eviction"] == 0
        first = chains[0]
        assert ns.lookup(first).tiers == ["remote"] * 4
        assert ns.get(first) == [content(k) for k in first]      # back from Redis
        # room for them: four more DRAM-only blocks written back, never the fetched ones
        assert remote_stats(ca)["write_backs"] == r["write_backs"] + 4
    a.stop()                                                      # SIGTERM: the rest goes
    b = remote_daemon_factory(redis_server.url)
    with Client(b.endpoint, tenant="acme") as cb:
        ns = cb.namespace(IDENT)
        for keys in chains:
            assert ns.get(keys) == [content(k) for k in keys]


def test_a_clean_stop_writes_back_after_a_hiccup_of_redis(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """A lookup that timed out in a moment's stall leaves the tier skipped for
    unhealthy_seconds; a clean stop within them wrote nothing back before, and every
    block only DRAM held was lost without a word.  The stop tries the store once more."""
    a = remote_daemon_factory(fresh_redis_server.url,
                              extra=["--remote-write-policy", "write-back",
                                     "--log-level", "error"],
                              env={"KVSTORE_REMOTE_TIMEOUT_S": "0.5",
                                   "KVSTORE_REMOTE_UNHEALTHY_SECONDS": "60"})
    with Client(a.endpoint, tenant="acme") as ca:
        ns = ca.namespace(IDENT)
        keys = ns.keys(range(4_500_000, 4_500_000 + 16 * 8))
        ns.put(keys, [content(k) for k in keys])
        fresh_redis_server.pause()
        try:
            assert ns.lookup(ns.keys(range(16 * 8))).blocks == 0  # times out: unhealthy
        finally:
            fresh_redis_server.resume()
        assert remote_stats(ca)["healthy"] is False
        assert remote_stats(ca)["writes"] == 0                    # all of it in DRAM only
    a.stop()                                                      # SIGTERM
    b = remote_daemon_factory(fresh_redis_server.url)
    with Client(b.endpoint, tenant="acme") as cb:
        ns = cb.namespace(IDENT)
        assert ns.get(keys) == [content(k) for k in keys]


def test_write_back_makes_room_in_a_dram_full_of_one_long_chain(
        redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """Write-back sends only leaves (a block written there leaves the cache here), and a
    long chain has one.  Before, a put that needed more slots than DRAM had leaves was
    refused, nothing written: DRAM full of one chain took no put of two blocks.  Now
    each round's leaves are written, and their parents are next."""
    d = remote_daemon_factory(redis_server.url, dram_capacity=str(64 * IDENT.block_bytes),
                              extra=["--slab-size", str(64 * IDENT.block_bytes),
                                     "--remote-write-policy", "write-back"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chain = ns.keys(range(8_500_000, 8_500_000 + 16 * 64))
        for start in range(0, 64, 16):
            part = chain[start:start + 16]
            ns.put(part, [content(k) for k in part], parent=chain[start - 1] if start else None)
        new = ns.keys(range(8_600_000, 8_600_000 + 16 * 40))
        ns.put(new, [content(k) for k in new])                   # 40 slots, one leaf
        stats = client.stats()
        assert stats["remote"]["write_backs"] >= 40
        assert stats["tiers"]["dram"]["dropped_on_eviction"] == 0
        assert ns.lookup(chain).blocks == 64                      # the rest of it remote
        assert ns.get(new) == [content(k) for k in new]
        assert client.stats()["invariant_violations"] == 0


def test_write_back_with_redis_down_evicts_instead_of_hanging(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    d = remote_daemon_factory(fresh_redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              extra=["--slab-size", str(16 * IDENT.block_bytes), "--log-level",
                                     "error", "--remote-write-policy", "write-back"])
    fresh_redis_server.kill()
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        started = time.monotonic()
        for i in range(10):                                       # 40 blocks into 16 slots
            keys = ns.keys(range(5_000_000 + 1000 * i, 5_000_000 + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
        assert time.monotonic() - started < 15, "puts waited on a dead remote store"
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        assert stats["tiers"]["dram"]["dropped_on_eviction"] >= 24
        assert ns.get(keys) == [content(k) for k in keys]


def test_write_back_into_a_full_redis_evicts_instead_of_refusing_every_put(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """Redis at its maxmemory under noeviction answers each SET with an OOM error: it is
    healthy, but keeps nothing more.  Before, the DRAM victims it refused went back on
    the eviction order, every request that needed room picked them again, was refused
    again, and failed ("blocks kept moving between tiers"): DRAM took no new block, and a
    get of blocks in Redis waited until the session's lease ran out.  Now the refusals
    leave the store out of write-backs for a while, and DRAM evicts without it."""
    with fresh_redis_server.client() as r:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", str(used + 20 * IDENT.block_bytes))
        r.config_set("maxmemory-policy", "noeviction")
    d = remote_daemon_factory(fresh_redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              extra=["--slab-size", str(16 * IDENT.block_bytes), "--log-level",
                                     "error", "--remote-write-policy", "write-back"])
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chains = []
        started = time.monotonic()
        for i in range(20):                                       # 80 blocks into 16 slots
            keys = ns.keys(range(5_500_000 + 1000 * i, 5_500_000 + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
            chains.append(keys)
        assert time.monotonic() - started < 15, "puts waited on a full remote store"
        stats = client.stats()
        assert stats["remote"]["refused_writes"] > 0
        assert stats["remote"]["healthy"] is True
        assert stats["tiers"]["dram"]["dropped_on_eviction"] > 0
        for keys in chains:                                      # what is found reads back
            if ns.lookup(keys).blocks == len(keys):
                assert ns.get(keys) == [content(k) for k in keys]
        assert ns.get(chains[-1]) == [content(k) for k in chains[-1]]
        assert client.stats()["invariant_violations"] == 0


def test_write_back_takes_what_the_ssd_tier_declines(
        redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """With an SSD tier that admits only blocks seen twice, DRAM's victims seen once go
    to the remote store instead of being lost."""
    d = remote_daemon_factory(redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              ssd_capacity="64MiB",
                              extra=["--slab-size", str(16 * IDENT.block_bytes),
                                     "--remote-write-policy", "write-back"],
                              env={"KVSTORE_SSD_ADMIT_AFTER": "2",
                                   "KVSTORE_SSD_SLAB_SIZE": "1MiB"})
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        chains = []
        for i in range(10):
            keys = ns.keys(range(6_000_000 + 1000 * i, 6_000_000 + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
            chains.append(keys)
        stats = client.stats()
        assert stats["remote"]["write_backs"] >= 24
        assert stats["tiers"]["dram"]["dropped_on_eviction"] == 0
        for keys in chains:
            assert ns.get(keys) == [content(k) for k in keys]
        assert client.stats()["invariant_violations"] == 0


def test_write_back_takes_what_the_ssd_tier_evicts(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """DRAM holds 16 blocks and SSD 32: the SSD tier is the last local one, so its copies
    nearest eviction are written back to the remote store first, and nothing put is
    lost when SSD evicts; after a restart (and a remote store that lost everything) the
    restored SSD copies count as unsent again."""
    import redis

    d = remote_daemon_factory(fresh_redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              ssd_capacity=str(32 * IDENT.block_bytes),
                              extra=["--slab-size", str(16 * IDENT.block_bytes),
                                     "--remote-write-policy", "write-back"],
                              env={"KVSTORE_SSD_SLAB_SIZE": str(16 * IDENT.block_bytes)})

    def put_chains(client: Client, base: int, count: int) -> list[list[bytes]]:
        ns = client.namespace(IDENT)
        chains = []
        for i in range(count):
            keys = ns.keys(range(base + 1000 * i, base + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
            chains.append(keys)
            if i % 3 == 2:  # read an older chain back: SSD's eviction order is not write order
                ns.get(chains[i // 2])
            wait_for(lambda: not remote_stats(client)["copying_from_ssd"], "the ssd copier")
        return chains

    def check(client: Client, chains: list[list[bytes]], evicted_at_least: int) -> None:
        stats = client.stats()
        ssd = stats["tiers"]["ssd"]
        assert ssd["evictions"] >= evicted_at_least
        assert ssd["evicted_unwritten"] == 0
        assert stats["remote"]["write_backs"] >= ssd["evictions"]
        ns = client.namespace(IDENT)
        assert ns.lookup(chains[0]).tiers == ["remote"] * 4       # gone from both tiers
        for keys in chains:
            assert ns.get(keys) == [content(k) for k in keys]
        assert client.stats()["invariant_violations"] == 0

    with Client(d.endpoint, tenant="acme") as client:
        chains = put_chains(client, 7_000_000, 25)                # 100 blocks
        check(client, chains, 100 - 16 - 32)
    d.stop()
    redis.Redis(host="127.0.0.1", port=fresh_redis_server.port).flushall()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        restored = [keys for keys in chains if ns.lookup(keys).tiers == ["ssd"] * 4]
        assert len(restored) >= 4
        more = put_chains(client, 8_000_000, 16)                  # 64 more: SSD turns over
        check(client, restored + more, 64 - 16)


def test_ssd_copies_evicted_unsent_are_counted_while_the_remote_store_is_down(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    d = remote_daemon_factory(fresh_redis_server.url, dram_capacity=str(16 * IDENT.block_bytes),
                              ssd_capacity=str(32 * IDENT.block_bytes),
                              extra=["--slab-size", str(16 * IDENT.block_bytes), "--log-level",
                                     "error", "--remote-write-policy", "write-back"],
                              env={"KVSTORE_SSD_SLAB_SIZE": str(16 * IDENT.block_bytes)})
    fresh_redis_server.kill()
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        for i in range(25):                                       # 100 blocks into 48 slots
            keys = ns.keys(range(9_000_000 + 1000 * i, 9_000_000 + 1000 * i + 16 * 4))
            ns.put(keys, [content(k) for k in keys])
        stats = client.stats()
        ssd = stats["tiers"]["ssd"]
        assert ssd["evictions"] > 0
        assert ssd["evicted_unwritten"] == ssd["evictions"]      # none could be sent
        assert stats["remote"]["write_backs"] == 0 and stats["remote"]["errors"] > 0
        assert ns.get(keys) == [content(k) for k in keys]          # local tiers serve
        assert stats["invariant_violations"] == 0


def test_a_remote_read_longer_than_the_lease_keeps_its_session(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """A client waiting on a reply sends nothing else, so a request the daemon worked on
    past the lease (a remote read of slow calls) ended its session under it: the reply
    was an error, and the client had to connect again.  Now a request whose bytes are
    moving keeps its session's lease (one waiting for room does not)."""
    d = remote_daemon_factory(fresh_redis_server.url, lease=1.0,
                              env={"KVSTORE_REMOTE_TIMEOUT_S": "4"})
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        keys = ns.keys(range(6_000_000, 6_000_000 + 4 * IDENT.block_tokens))
        ns.put(keys, [content(k) for k in keys])
        wait_for(lambda: remote_stats(client)["writes"] >= 4, "write-through to the remote")
        assert ns.evict(keys) == 4 and ns.lookup(keys).tiers == ["remote"] * 4
        with fresh_redis_server.client() as r:
            r.execute_command("CLIENT", "PAUSE", "2500", "ALL")  # 2.5 s, the lease 1
        started = time.monotonic()
        assert ns.get(keys) == [content(k) for k in keys]
        assert time.monotonic() - started > 1.5
        client.ping()  # the same session, still there (else: lease expired)
        assert ns.lookup(keys).blocks == 4
        assert client.stats()["sessions"] == 1


def test_a_request_sent_while_the_daemon_stops_is_refused_at_once(
        fresh_redis_server: RedisServer, remote_daemon_factory: Any) -> None:
    """Before, a stopping daemon read no more requests: one sent while it finished the
    work under way (here a remote read held up by a paused Redis) got no reply, and its
    client waited out its timeout."""
    d = remote_daemon_factory(fresh_redis_server.url, env={"KVSTORE_REMOTE_TIMEOUT_S": "6"})
    with Client(d.endpoint, tenant="acme", timeout=15) as reader, \
            Client(d.endpoint, tenant="acme", timeout=15) as other:
        ns = reader.namespace(IDENT)
        keys = ns.keys(range(7_000_000, 7_000_000 + 4 * IDENT.block_tokens))
        ns.put(keys, [content(k) for k in keys])
        wait_for(lambda: remote_stats(reader)["writes"] >= 4, "write-through to the remote")
        assert ns.evict(keys) == 4
        with fresh_redis_server.client() as r:
            r.execute_command("CLIENT", "PAUSE", "4000", "ALL")
        got: list[object] = []
        def read() -> None:
            try:
                got.append(ns.get(keys))
            except KVStoreError as exc:
                got.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.5)  # (the read under way)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="stopping"):
            other.ping()
        assert time.monotonic() - started < 2.0
        thread.join(20)
        assert got == [[content(k) for k in keys]], d.log()[-3000:]  # the read was finished
