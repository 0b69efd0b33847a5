"""The redis backend beyond the contract: packers, TTL, a full server, outages and restarts,
and the data path's replies."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster

from kvstore.errors import KVStoreError, UnavailableError
from kvstore.plugins import GuardedBackend, load_backend
from kvstore.plugins.redis_backend import RedisBackend, passed_on

from redis_servers import RedisServer, free_port

MiB = 1 << 20
TIMEOUT_S = 0.5
SLACK_S = 1.0  # scheduling noise on a loaded 2-vCPU machine


def redis_inner(backend: GuardedBackend) -> RedisBackend:
    assert isinstance(backend.inner, RedisBackend)
    return backend.inner


def test_large_values_go_through_the_python_packer(redis_server: RedisServer) -> None:
    """The hiredis packer was unreliable for 2 MiB SETs: redis-py, which carries values on
    a cluster's redirections, must not use it (redis-py 8 packs with hiredis where it is
    installed, unless a value is a memoryview, as the backend hands them)."""

    async def scenario() -> None:
        async with load_backend("redis", {"url": redis_server.url}) as backend:
            client = redis_inner(backend)._client
            assert isinstance(client, redis.asyncio.Redis)
            connection = client.connection_pool.make_connection()
            value = os.urandom(2 * MiB)
            chunks = connection.pack_command("SET", b"key", passed_on(value))
            assert any(isinstance(chunk, memoryview) and chunk.obj is value
                       for chunk in chunks), "the value is passed on, not re-packed"

    asyncio.run(scenario())


def test_the_cluster_uses_the_same_connection_class() -> None:
    backend = load_backend("redis", {"url": "redis+cluster://127.0.0.1:1"})
    client = redis_inner(backend)._client
    assert isinstance(client, RedisCluster)
    connection_class = client.connection_kwargs["connection_class"]
    assert connection_class.pack_command is redis.asyncio.Connection.pack_command


def test_ttl_is_set_when_configured(redis_server: RedisServer) -> None:
    namespace, key = os.urandom(16), os.urandom(16)

    async def scenario() -> bytes:
        async with load_backend("redis", {"url": redis_server.url, "ttl_s": 100}) as backend:
            await backend.put(namespace, [key], [b"v"])
        return redis_inner(backend).redis_key(namespace, key)

    stored_key = asyncio.run(scenario())
    with redis_server.client() as client:
        assert 0 < client.ttl(stored_key) <= 100
        assert stored_key.startswith(b"kvstore:" + namespace)


def test_a_full_server_fails_puts_per_key(fresh_redis_server: RedisServer) -> None:
    with fresh_redis_server.client() as client:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 3 * MiB)
        client.config_set("maxmemory-policy", "noeviction")
    namespace = os.urandom(16)
    keys = [os.urandom(16) for _ in range(6)]

    async def scenario() -> None:
        options = {"url": fresh_redis_server.url, "connections": 1}
        async with load_backend("redis", options) as backend:
            stored = await backend.put(namespace, keys, [os.urandom(MiB)] * len(keys))
            assert stored[0] and not stored[-1], stored
            health = await backend.health()
            assert health.ok and health.capacity_bytes == used + 3 * MiB

    asyncio.run(scenario())


def test_a_frozen_server_times_out_and_recovers(fresh_redis_server: RedisServer) -> None:
    namespace, keys = os.urandom(16), [os.urandom(16) for _ in range(4)]
    values = [os.urandom(MiB) for _ in keys]

    async def scenario() -> None:
        options = {"url": fresh_redis_server.url, "timeout_s": TIMEOUT_S}
        async with load_backend("redis", options) as backend:
            assert await backend.put(namespace, keys, values) == [True] * 4
            fresh_redis_server.pause()
            try:
                buffers = [memoryview(bytearray(MiB)) for _ in keys]
                for call in (
                    lambda: backend.get_into(namespace, keys, buffers),
                    lambda: backend.put(namespace, keys, values),
                    lambda: backend.exists(namespace, keys),
                ):
                    started = time.monotonic()
                    with pytest.raises(UnavailableError):
                        await call()
                    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
                started = time.monotonic()
                health = await backend.health()
                assert not health.ok
                assert time.monotonic() - started < TIMEOUT_S + SLACK_S
            finally:
                fresh_redis_server.resume()
            assert await backend.get_into(namespace, keys, buffers) == [True] * 4
            assert [bytes(b) for b in buffers] == values
            assert (await backend.health()).ok

    asyncio.run(scenario())


def test_killed_mid_transfer_then_restarted(fresh_redis_server: RedisServer) -> None:
    namespace, keys = os.urandom(16), [os.urandom(16) for _ in range(16)]
    values = [os.urandom(2 * MiB) for _ in keys]

    async def scenario() -> None:
        options = {"url": fresh_redis_server.url, "timeout_s": TIMEOUT_S}
        async with load_backend("redis", options) as backend:
            assert await backend.put(namespace, keys, values) == [True] * len(keys)
            one_done = asyncio.Event()

            async def keep_reading() -> None:
                buffers = [memoryview(bytearray(2 * MiB)) for _ in keys]
                while True:
                    await backend.get_into(namespace, keys, buffers)
                    one_done.set()

            reader = asyncio.create_task(keep_reading())
            await one_done.wait()
            await asyncio.sleep(0.005)  # into the next batch of 32 MiB
            fresh_redis_server.kill()
            killed_at = time.monotonic()
            with pytest.raises(KVStoreError) as caught:
                await asyncio.wait_for(reader, TIMEOUT_S + SLACK_S)
            assert isinstance(caught.value, UnavailableError), caught.value
            assert time.monotonic() - killed_at < TIMEOUT_S + SLACK_S

            health = await backend.health()
            assert not health.ok and "unreachable" in health.detail
            for call in (
                lambda: backend.exists(namespace, keys),
                lambda: backend.put(namespace, keys[:1], values[:1]),
                lambda: backend.delete(namespace, keys),
            ):
                with pytest.raises(UnavailableError):
                    await call()

            fresh_redis_server.start()  # same port, empty: nothing was persisted
            assert (await backend.health()).ok
            assert await backend.exists(namespace, keys) == 0
            assert await backend.put(namespace, keys[:2], values[:2]) == [True, True]
            buffers = [memoryview(bytearray(2 * MiB)) for _ in range(2)]
            assert await backend.get_into(namespace, keys[:2], buffers) == [True, True]
            assert [bytes(b) for b in buffers] == values[:2]

    asyncio.run(scenario())


def test_nothing_listening_is_unavailable_at_once() -> None:
    async def scenario() -> None:
        url = f"redis://127.0.0.1:{free_port()}/0"
        async with load_backend("redis", {"url": url, "timeout_s": 5}) as backend:
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="redis backend at"):
                await backend.exists(os.urandom(16), [os.urandom(16)])
            assert time.monotonic() - started < 1.0, "a refused connection is not retried for long"
            assert not (await backend.health()).ok

    asyncio.run(scenario())


def test_a_pipeline_of_mixed_replies_stays_in_step(redis_server: RedisServer) -> None:
    """Hits, misses, wrong sizes and wrong types in one batch, on one connection: each
    reply is read whole (the data path receives payloads straight into the buffers)."""
    namespace = os.urandom(16)
    keys = [os.urandom(16) for _ in range(8)]
    sizes = [2 * MiB, 300, 2 * MiB, 70_000, 1, 2 * MiB, 4096, 256 * 1024]
    values = [os.urandom(size) for size in sizes]

    async def scenario() -> None:
        async with load_backend("redis", {"url": redis_server.url, "connections": 1}) as backend:
            stored = [i for i in range(8) if i not in (1, 5)]  # 1 and 5 are never stored
            assert await backend.put(namespace, [keys[i] for i in stored],
                                     [values[i] for i in stored]) == [True] * len(stored)
            with redis_server.client() as client:  # 3: a list where a value should be
                list_key = redis_inner(backend).redis_key(namespace, keys[3])
                client.delete(list_key)
                client.rpush(list_key, b"x")
            buffers = [memoryview(bytearray(size)) for size in sizes]
            buffers[6] = memoryview(bytearray(4095))  # 6: the stored value is a byte longer
            found = await backend.get_into(namespace, keys, buffers)
            assert found == [True, False, True, False, True, False, False, True]
            for i in (0, 2, 4, 7):
                assert bytes(buffers[i]) == values[i]
            assert backend.counters.corrupt_values == 2  # the list, and the wrong size
            again = [memoryview(bytearray(sizes[0]))]  # the connection is still in step
            assert await backend.get_into(namespace, keys[:1], again) == [True]
            assert bytes(again[0]) == values[0]

    asyncio.run(scenario())


def test_values_go_out_without_a_joined_copy() -> None:
    from kvstore.plugins.resp import pack_set

    value = memoryview(bytearray(os.urandom(MiB)))
    buffers = pack_set(b"key", b"h" * 24, value, ttl_s=60)
    assert any(buffer is value for buffer in buffers)
    assert b"".join(bytes(b) for b in buffers) == (
        b"*5\r\n$3\r\nSET\r\n$3\r\nkey\r\n$%d\r\n" % (24 + MiB) + b"h" * 24 + bytes(value)
        + b"\r\n$2\r\nEX\r\n$2\r\n60\r\n")


def test_the_generation_outlives_a_restart_with_the_data_but_not_an_empty_store(
        fresh_redis_server: RedisServer) -> None:
    """The token the daemon checks to tell a store that lost what it held: the same
    while the server keeps its keys (a restart that loads them again included), another
    after FLUSHALL or a restart without them."""
    url = fresh_redis_server.url

    async def generation() -> bytes | None:
        async with load_backend("redis", {"url": url, "timeout_s": 2.0}) as backend:
            first = await backend.generation()
            assert await backend.generation() == first
            return first

    first = asyncio.run(generation())
    assert first
    with fresh_redis_server.client() as client:
        assert client.get(b"kvstore:generation") == first
        assert client.ttl(b"kvstore:generation") == -1              # never expires
        client.save()
    fresh_redis_server.kill()
    fresh_redis_server.start()                                       # its RDB loaded again
    assert asyncio.run(generation()) == first
    with fresh_redis_server.client() as client:
        client.flushall()
    second = asyncio.run(generation())
    assert second not in (None, first)
    (fresh_redis_server.workdir / "dump.rdb").unlink()
    fresh_redis_server.kill()
    fresh_redis_server.start()                                       # empty
    assert asyncio.run(generation()) not in (None, first, second)


def test_the_generation_evicted_by_redis_itself_is_put_back(
        fresh_redis_server: RedisServer) -> None:
    """Under allkeys-lru Redis evicts the token like any key: the same server having
    evicted keys since, it is put back as it was, not taken for a store that lost what
    it held (before, daemons forgot every mark each time)."""
    with fresh_redis_server.client() as client:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 4 * MiB)
        client.config_set("maxmemory-policy", "allkeys-lru")
    namespace = os.urandom(16)

    async def scenario() -> None:
        async with load_backend("redis", {"url": fresh_redis_server.url}) as backend:
            first = await backend.generation()
            assert first
            with fresh_redis_server.client() as client:
                for _ in range(64):                         # until Redis evicts the token
                    await backend.put(namespace, [os.urandom(16)], [os.urandom(MiB // 4)])
                    if client.get(b"kvstore:generation") is None:
                        break
                assert client.get(b"kvstore:generation") is None
                assert await backend.generation() == first
                assert client.get(b"kvstore:generation") == first
                client.flushall()                           # no eviction: a loss
            assert await backend.generation() not in (None, first)

    asyncio.run(scenario())
