"""A value found corrupt in the remote store must stop being reported as held there.

A real daemon over a real redis-server.  Measured before: after the read of a chain whose
second value was damaged in Redis failed ("missing or corrupt"), lookup still reported
all 4 blocks (the store's EXISTS finds the key), and each of 5 acquires read it again, one
more miss each (``corrupt_values`` 5).  Now the damaged value is deleted once found:
lookup reports the 1 block before it, and no read of it is made again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(tenant="acme")
PREFIX = b"kvstore:"
RACING = Path(__file__).resolve().parents[1] / "racing_writer.py"


def written_chain(daemon_factory: Any, redis: RedisServer) -> list[bytes]:
    """Four blocks of 7s, written through to ``redis`` by a daemon."""
    writer = daemon_factory(extra=["--remote", redis.url])
    with Client(writer.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys: list[bytes] = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys, [b"\x07" * IDENT.block_bytes for _ in keys])
        deadline = time.monotonic() + 20
        while c.stats()["remote"]["writes"] < 4:
            assert time.monotonic() < deadline, "never written"
            time.sleep(0.05)
    return keys


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


def test_a_good_value_written_after_the_read_is_not_deleted(
        daemon_factory: Any, fresh_redis_server: RedisServer, tmp_path: Path) -> None:
    """Another daemon writes good values between the read that found one corrupt (and
    the next missing) and the delete.  Before, both keys were deleted (UNLINK of every
    key of the batch that read as a miss): their good values lost to every daemon of
    the store.  Now only a value still the corrupt one read is deleted: both stay."""
    redis = fresh_redis_server
    keys = written_chain(daemon_factory, redis)
    names = [PREFIX + IDENT.namespace_id + k for k in keys[1:3]]
    good = [redis.client().get(name) for name in names]
    assert None not in good
    redis.client().set(names[0], good[0][:-1] + bytes([good[0][-1] ^ 1]))  # corrupt
    redis.client().delete(names[1])  # missing
    race = tmp_path / "race.json"
    race.write_text(json.dumps({"url": redis.url, "values": {
        name.hex(): value.hex() for name, value in zip(names, good)}}))
    reader = DaemonProcess(tmp_path / "reader", extra=["--remote", redis.url],
                           env={"RACE_VALUES": str(race)}).run_through(RACING).start()
    try:
        read_while_racing(reader, redis, keys, names, good)
    finally:
        reader.stop()


def read_while_racing(reader: DaemonProcess, redis: RedisServer, keys: list[bytes],
                      names: list[bytes], good: list[bytes]) -> None:
    with Client(reader.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        with pytest.raises(NotFoundError):
            ns.get(keys)  # k1 corrupt, k2 missing; both written again right after
        deadline = time.monotonic() + 20
        while (r := c.stats()["remote"])["corrupt_deleted"] + r.get("corrupt_changed", 0) < 1:
            assert time.monotonic() < deadline, r
            time.sleep(0.05)
        assert [redis.client().get(name) for name in names] == good, c.stats()["remote"]
        assert r["corrupt_deleted"] == 0 and r["corrupt_changed"] == 1, r
        assert ns.get(keys) == [b"\x07" * IDENT.block_bytes] * 4


def test_a_store_user_that_may_not_delete_keeps_the_tier_up(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Before, a corrupt value read by a daemon whose Redis user may not DEL (an ACL)
    failed the delete, and the whole remote tier was skipped for every tenant
    (``healthy`` False) at each such read.  Now the refusal is logged and counted."""
    redis = fresh_redis_server
    keys = written_chain(daemon_factory, redis)
    name = PREFIX + IDENT.namespace_id + keys[1]
    value = redis.client().get(name)
    redis.client().set(name, value[:-1] + bytes([value[-1] ^ 1]))
    redis.client().acl_setuser("nodel", enabled=True, passwords=["+pw"], keys=["*"],
                               channels=["*"], commands=["+@all", "-del", "-unlink"])
    url = redis.url.replace("redis://", "redis://nodel:pw@")
    reader = daemon_factory(extra=["--remote", url])
    with Client(reader.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        with pytest.raises(NotFoundError):
            ns.get(keys)
        deadline = time.monotonic() + 20
        while not ((r := c.stats()["remote"]).get("corrupt_deletes_refused")
                   or not r["healthy"]):
            assert time.monotonic() < deadline, r
            time.sleep(0.05)
        assert r["healthy"] and r["corrupt_deletes_refused"] == 1, r
        assert redis.client().exists(name) == 1
        assert ns.get(keys[:1]) == [b"\x07" * IDENT.block_bytes]  # (served still)
