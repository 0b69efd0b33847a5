"""A remote store that stops answering costs each send queued behind it no timeout of its
own, and the write-through blocks committed meanwhile reach it once it is back.

A real daemon, write-through to a real redis-server frozen with SIGSTOP.  Before, every
send already queued when the tier was marked unhealthy waited its full ``timeout_s``
(one after another, ``concurrency`` at a time: the timeouts kept climbing after the
"skipping the remote tier" warning, holding transfer slots the local tiers share), and
blocks committed while it was unhealthy were never sent, nothing counted.
"""

from __future__ import annotations

import time
from typing import Any

from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

IDENT = make_identity()
CHAIN = 4


def wait_for(check: Any, what: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_outage_times_out_once_and_defers_the_writes(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    d = daemon_factory(extra=["--remote", fresh_redis_server.url,
                              "--remote-write-policy", "write-through"],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "0.5",
                            "KVSTORE_REMOTE_CONCURRENCY": "1",
                            "KVSTORE_REMOTE_UNHEALTHY_SECONDS": "2"})
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)

        def put(i: int) -> None:
            keys = ns.keys(range(i * 1000, i * 1000 + CHAIN * IDENT.block_tokens))
            ns.put(keys, [bytes([i]) * IDENT.block_bytes for _ in keys])

        def remote() -> dict[str, Any]:
            return c.stats()["remote"]  # type: ignore[no-any-return]

        put(0)
        wait_for(lambda: remote()["writes"] == CHAIN, "the first chain never reached redis")
        fresh_redis_server.pause()
        try:
            for i in range(1, 11):  # ten commits, each its own write-through
                put(i)
            wait_for(lambda: not remote()["healthy"], "the outage was never noticed")
            time.sleep(1.5)  # (before: a timeout every half second, one send after another)
            during = remote()
            assert during["timeouts"] <= 2, during
            assert during["deferred_writes"] >= 9 * CHAIN, during
            assert during["writes"] == CHAIN
        finally:
            fresh_redis_server.resume()
        time.sleep(2.1)  # the tier is skipped for 2 s after its last failure
        wait_for(lambda: remote()["healthy"], "the tier never came back")
        put(11)  # a commit once it is healthy sends those held back with its own
        wait_for(lambda: remote()["writes"] == 12 * CHAIN,
                 f"the deferred writes never reached redis: {remote()}")
        assert remote()["unsent_writes"] == 0
    keys = fresh_redis_server.client().dbsize()
    assert keys >= 12 * CHAIN
