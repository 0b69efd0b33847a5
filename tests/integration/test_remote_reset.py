"""The remote tier when Redis loses what it held (restarted empty, flushed, failed over to
an empty replica), evicts under us (maxmemory with allkeys-lru), or restarts with its data.

A real daemon, write-back to a real redis-server.  The daemon marks the blocks it knows
the remote store holds, and DRAM drops a marked block without writing it back.  Before,
those marks outlived a Redis that came back empty: the blocks fetched from Redis, or
written there, were dropped from DRAM as if Redis still held them, and lost.  Now the
daemon keeps a generation key in the store, checks it every ``remote.check_seconds``,
and when it is gone (or another) forgets its marks, a slice a loop turn, so that what
DRAM still holds is written back again.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB
CHECK = {"KVSTORE_REMOTE_CHECK_SECONDS": "0.2"}


def content(key: bytes) -> bytes:
    return (hashlib.blake2b(key, digest_size=32).digest() * (IDENT.block_bytes // 32 + 1))[
        : IDENT.block_bytes]


def wait_for(predicate: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stats(client: Client) -> dict[str, Any]:
    out: dict[str, Any] = client.stats()
    assert out["invariant_violations"] == 0
    return out


def write_back_daemon(factory: Any, url: str, **kw: Any) -> Any:
    return factory(dram_capacity=str(16 * IDENT.block_bytes),
                   extra=["--remote", url, "--slab-size", str(16 * IDENT.block_bytes),
                          "--remote-write-policy", "write-back", "--log-level", "error"],
                   env=CHECK, **kw)


def put_chains(ns: Any, first: int, count: int) -> list[list[bytes]]:
    chains = []
    for i in range(count):
        keys = ns.keys(range(first + 1000 * i, first + 1000 * i + 16 * 4))
        ns.put(keys, [content(k) for k in keys])
        chains.append(keys)
    return chains


def fetched_back(ns: Any, client: Client) -> list[bytes]:
    """A chain written back to Redis, then read back into DRAM (marked as in Redis)."""
    chain = put_chains(ns, 10_000_000, 1)[0]
    put_chains(ns, 11_000_000, 8)                                 # evicts it: to Redis
    assert ns.lookup(chain).tiers == ["remote"] * 4
    assert ns.get(chain) == [content(k) for k in chain]          # back in DRAM
    assert ns.lookup(chain).tiers == ["dram"] * 4
    return chain


def written_again_once_noticed(ns: Any, client: Client, chain: list[bytes],
                               lost: str) -> None:
    """The daemon notices the store ``lost`` what it held and forgets the chain's marks;
    evicted again, the chain is written back this time, and read back whole."""
    wait_for(lambda: stats(client)["remote"]["generations_lost"] == 1,
             f"the daemon to notice that {lost}")
    wait_for(lambda: stats(client)["remote"]["marks_forgotten"] >= 4,
             "the marks to be forgotten")
    put_chains(ns, 12_000_000, 8)                                 # evicts the chain again
    assert ns.lookup(chain).tiers == ["remote"] * 4               # written back this time
    assert ns.get(chain) == [content(k) for k in chain]


@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_blocks_in_dram_are_written_back_again_after_redis_comes_back_empty(
        how: str, daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    d = write_back_daemon(daemon_factory, fresh_redis_server.url)
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chain = fetched_back(ns, client)
        before = stats(client)["remote"]
        assert before["generations_lost"] == 0
        if how == "restart":
            fresh_redis_server.kill()
            fresh_redis_server.start()                            # empty: no persistence
        else:
            with fresh_redis_server.client() as r:
                r.flushall()
        written_again_once_noticed(ns, client, chain, "Redis lost its keys")
        after = stats(client)
        assert after["remote"]["generations_lost"] == 1
        assert after["tiers"]["dram"]["reserved_slots"] == 0


def test_redis_restarted_with_its_data_keeps_the_marks(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    d = write_back_daemon(daemon_factory, fresh_redis_server.url)
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chain = fetched_back(ns, client)
        with fresh_redis_server.client() as r:
            r.save()                                              # its RDB file, loaded again
        fresh_redis_server.kill()
        fresh_redis_server.start()
        with fresh_redis_server.client() as r:
            assert r.dbsize() > 0
        checks = stats(client)["remote"]["generation_checks"]
        wait_for(lambda: stats(client)["remote"]["generation_checks"] >= checks + 3,
                 "the daemon to check the store's generation again")
        written = stats(client)["remote"]["write_backs"]
        put_chains(ns, 13_000_000, 5)                             # evicts the chain again
        after = stats(client)["remote"]
        assert after["generations_lost"] == 0 and after["marks_forgotten"] == 0
        # the chain left DRAM as held by Redis: the 12 blocks DRAM held beside it and 4
        # of the 20 new ones were written back, not the chain again
        assert after["write_backs"] - written == 16
        assert ns.get(chain) == [content(k) for k in chain]


def test_redis_evicting_under_us_is_a_clean_miss(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Redis at a small maxmemory under allkeys-lru drops our keys as it likes: each chain
    reads back whole and right, or is a clean miss (the reservation given back, no
    error, the tier healthy, the counts and the invariant check agreeing)."""
    with fresh_redis_server.client() as r:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", str(used + 24 * IDENT.block_bytes))
        r.config_set("maxmemory-policy", "allkeys-lru")
    d = write_back_daemon(daemon_factory, fresh_redis_server.url)
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chains = put_chains(ns, 14_000_000, 20)                  # 80 blocks
        with fresh_redis_server.client() as r:
            assert int(r.info("stats")["evicted_keys"]) > 0
        checks = stats(client)["remote"]["generation_checks"]
        wait_for(lambda: stats(client)["remote"]["generation_checks"] >= checks + 3,
                 "the daemon to check the store's generation again")
        found = missed = 0
        for keys in chains:
            misses = stats(client)["remote"]["misses"]
            try:
                got = ns.get(keys)
            except NotFoundError:
                missed += 1
                now = stats(client)
                assert now["remote"]["misses"] == misses + 1
                assert now["tiers"]["dram"]["reserved_slots"] == 0
                assert ns.lookup(keys).blocks < len(keys)
            else:
                found += 1
                assert got == [content(k) for k in keys]
        assert missed > 0 and found > 0
        end = stats(client)
        assert end["remote"]["errors"] == 0 and end["remote"]["healthy"] is True
        assert end["remote"]["corrupt_values"] == 0
        # Redis evicted the generation's token too, now and then: put back as it was,
        # the store's contents otherwise as they were, never a loss
        assert end["remote"]["generations_lost"] == 0, end["remote"]
        assert end["tiers"]["dram"]["reserved_slots"] == 0


def test_a_stop_after_redis_lost_its_keys_writes_back_what_it_marked(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Redis flushed, then the daemon stopped before its next check (60 s away): the
    stop's write-back checks the generation first, so the blocks marked as held by
    Redis go too, and another daemon finds them."""
    a = daemon_factory(dram_capacity=str(16 * IDENT.block_bytes),
                       extra=["--remote", fresh_redis_server.url, "--slab-size",
                              str(16 * IDENT.block_bytes), "--remote-write-policy",
                              "write-back", "--log-level", "error"],
                       env={"KVSTORE_REMOTE_CHECK_SECONDS": "60"})
    with Client(a.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chain = fetched_back(ns, client)
        assert stats(client)["remote"]["generation_checks"] == 1  # the first, at start
        with fresh_redis_server.client() as r:
            r.flushall()
    a.stop()                                                      # SIGTERM
    b = daemon_factory(extra=["--remote", fresh_redis_server.url])
    with Client(b.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        assert ns.get(chain) == [content(k) for k in chain]


def test_write_through_sends_again_what_dram_holds_after_a_flush(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    a = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env=CHECK)
    b = daemon_factory(extra=["--remote", fresh_redis_server.url])
    with Client(a.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chain = put_chains(ns, 15_000_000, 1)[0]
        wait_for(lambda: stats(client)["remote"]["writes"] == 4, "the write-through")
        with fresh_redis_server.client() as r:
            r.flushall()
        wait_for(lambda: stats(client)["remote"]["generations_lost"] == 1,
                 "the daemon to notice that Redis lost its keys")
        wait_for(lambda: stats(client)["remote"]["writes"] == 8, "the chain sent again")
    with Client(b.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        assert ns.lookup(chain).tiers == ["remote"] * 4
        assert ns.get(chain) == [content(k) for k in chain]


def test_ssd_copies_marked_as_sent_are_sent_again_after_a_flush(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """DRAM 16 blocks, SSD 32, write-back: the SSD copies nearest eviction are sent to
    Redis, and SSD evicts those first, as Redis holds them.  Redis flushed, those marks
    go, and the copies nearest eviction are sent again at once (before, at SSD's next
    write, whose eviction came first), and the rest before SSD evicts them: every chain
    cached here when Redis lost its keys still reads back after SSD turned over."""
    d = daemon_factory(dram_capacity=str(16 * IDENT.block_bytes),
                       ssd_capacity=str(32 * IDENT.block_bytes),
                       extra=["--remote", fresh_redis_server.url, "--slab-size",
                              str(16 * IDENT.block_bytes), "--remote-write-policy",
                              "write-back", "--log-level", "error"],
                       env={**CHECK, "KVSTORE_SSD_SLAB_SIZE": str(16 * IDENT.block_bytes)})
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)

        def put(base: int, count: int) -> list[list[bytes]]:
            chains = []
            for i in range(count):
                chains += put_chains(ns, base + 1000 * i, 1)
                wait_for(lambda: not stats(client)["remote"]["copying_from_ssd"],
                         "the ssd copier")
            return chains

        chains = put(16_000_000, 25)                              # 100 blocks
        local = [keys for keys in chains
                 if set(ns.lookup(keys).tiers) <= {"dram", "ssd"}
                 and ns.lookup(keys).blocks == 4]
        assert sum(ns.lookup(keys).tiers.count("ssd") for keys in local) >= 16
        with fresh_redis_server.client() as r:
            r.flushall()
        wait_for(lambda: stats(client)["remote"]["generations_lost"] == 1,
                 "the daemon to notice that Redis lost its keys")
        wait_for(lambda: not stats(client)["remote"]["forgetting_marks"], "the marks")
        wait_for(lambda: not stats(client)["remote"]["copying_from_ssd"], "the ssd copier")
        put(17_000_000, 16)                                       # 64 more: SSD turns over
        for keys in local:
            assert ns.get(keys) == [content(k) for k in keys]
        assert stats(client)["tiers"]["ssd"]["evicted_unwritten"] == 0


def test_the_event_stream_withdraws_the_remote_copies_redis_lost(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Routers learn of remote copies from the KV event stream: those Redis lost are
    withdrawn once the daemon notices (BlockRemoved, STORAGE/REMOTE), the DRAM copies
    staying announced."""
    from events_sub import Subscriber
    from redis_servers import free_port

    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity=str(16 * IDENT.block_bytes),
                       extra=["--remote", fresh_redis_server.url, "--slab-size",
                              str(16 * IDENT.block_bytes), "--remote-write-policy",
                              "write-back", "--log-level", "error"],
                       env={**CHECK, "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme", timeout=10) as client:
            ns = client.namespace(IDENT)
            chain = fetched_back(ns, client)
            sub.until(client.snapshot().seq)
            assert all(sub.index.tiers[k] == {"dram", "remote"} for k in chain)
            with fresh_redis_server.client() as r:
                r.flushall()
            wait_for(lambda: stats(client)["remote"]["generations_lost"] == 1
                     and not stats(client)["remote"]["forgetting_marks"],
                     "the daemon to forget what Redis lost")
            sub.until(client.snapshot().seq)
            assert all(sub.index.tiers[k] == {"dram"} for k in chain)
    finally:
        sub.close()


def test_a_wiped_fs_store_is_noticed_and_what_dram_holds_written_again(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The fs backend keeps its generation too: a directory emptied under the daemon (a
    wiped folder, another filesystem mounted there) left every mark standing, and the
    blocks DRAM then let go unwritten were lost."""
    root = tmp_path / "remote"
    d = write_back_daemon(daemon_factory, f"fs://{root}")
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        chain = fetched_back(ns, client)
        wait_for(lambda: stats(client)["remote"]["generation_checks"] >= 1,
                 "a first generation check")
        shutil.rmtree(root)
        written_again_once_noticed(ns, client, chain, "the directory lost its files")
