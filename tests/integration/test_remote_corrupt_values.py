"""A value found corrupt in the remote store must stop being reported as held there.

A real daemon over a real redis-server.  Measured before: after the read of a chain whose
second value was damaged in Redis failed ("missing or corrupt"), lookup still reported
all 4 blocks (the store's EXISTS finds the key), and each of 5 acquires read it again, one
more miss each (``corrupt_values`` 5).  Now the damaged value is deleted once found:
lookup reports the 1 block before it, and no read of it is made again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(tenant="acme")
PREFIX = b"kvstore:"


def test_a_corrupt_value_is_deleted_once_found(daemon_factory: Any,
                                               fresh_redis_server: RedisServer) -> None:
    redis = fresh_redis_server
    writer = daemon_factory(extra=["--remote", redis.url])
    with Client(writer.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys, [b"\x07" * IDENT.block_bytes for _ in keys])
        deadline = time.monotonic() + 20
        while c.stats()["remote"]["writes"] < 4:
            assert time.monotonic() < deadline, "never written"
            time.sleep(0.05)
    name = PREFIX + IDENT.namespace_id + keys[1]
    value = redis.client().get(name)
    assert value is not None
    redis.client().set(name, value[:-1] + bytes([value[-1] ^ 1]))  # one bit flipped
    reader = daemon_factory(extra=["--remote", redis.url])  # holds nothing locally
    with Client(reader.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        assert ns.lookup(keys).blocks == 4  # (the store has all four keys)
        for _ in range(5):
            with pytest.raises(NotFoundError):
                ns.get(keys)
            deadline = time.monotonic() + 20
            while ns.lookup(keys).blocks != 1:
                assert time.monotonic() < deadline, (ns.lookup(keys), c.stats()["remote"])
                time.sleep(0.05)
        remote = c.stats()["remote"]
        assert remote["corrupt_values"] == 1, remote  # found once, then not read again
        assert remote["corrupt_deleted"] == 1, remote
        assert redis.client().exists(name) == 0
        assert ns.get(keys[:1]) == [b"\x07" * IDENT.block_bytes]
