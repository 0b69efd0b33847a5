"""The redis backend deletes a value read as corrupt only while it is still the value
read (``kvstore.plugins.redis_corrupt``), against a real redis-server."""

from __future__ import annotations

import asyncio
import os

from kvstore.plugins import load_backend

from redis_servers import RedisServer

SIZE = 4096


def test_only_values_still_as_read_corrupt_are_deleted(redis_server: RedisServer) -> None:
    ns = os.urandom(16)
    keys = [os.urandom(16) for _ in range(5)]
    client = redis_server.client()
    names = [b"kvstore:" + ns + k for k in keys]

    async def scenario() -> tuple[list[int | None], int]:
        async with load_backend("redis", {"url": redis_server.url}) as backend:
            await backend.put(ns, keys, [bytes([i]) * SIZE for i in range(5)])
            good = [client.get(name) for name in names]
            client.set(names[0], good[0][:-1] + b"\xff")   # a byte changed: stays so
            client.set(names[1], good[1][:-1])             # short, then good again
            client.delete(names[2])
            client.rpush(names[2], b"x")                   # not a string
            client.delete(names[3])                        # missing, then written
            client.set(names[4], good[4][:-1] + b"\xff")   # corrupt, then otherwise
            bufs = [memoryview(bytearray(SIZE)) for _ in keys]
            sums = await backend.get_into_checksums(ns, keys, bufs)
            client.set(names[1], good[1])
            client.set(names[3], good[3])
            client.set(names[4], good[4][:-1] + b"\xfe")
            return sums, await backend.delete_corrupt(ns, keys)

    sums, deleted = asyncio.run(scenario())
    assert sums == [None] * 5
    assert deleted == 2
    assert [client.exists(name) for name in names] == [0, 1, 0, 1, 1]
