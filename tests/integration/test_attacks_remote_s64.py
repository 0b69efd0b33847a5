"""The remote tier attacked as an unlucky operator would: a real daemon, a real
redis-server killed, restarted empty or configured to expire values.

Each test failed before its fix (the figures are in its docstring)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

IDENT = make_identity()
CHAIN = 4
PREFIX = b"kvstore:"


def wait_for(check: Any, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def put_chain(ns: Any, i: int) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(i * 1000, i * 1000 + CHAIN * IDENT.block_tokens))
    ns.put(keys, [bytes([i]) * IDENT.block_bytes for _ in keys])
    return keys


def in_redis(redis: RedisServer, keys: list[bytes]) -> int:
    """How many of ``keys`` (of IDENT's namespace) the server holds."""
    client = redis.client()
    return sum(client.exists(PREFIX + IDENT.namespace_id + k) for k in keys)


def test_write_throughs_held_back_go_on_a_clean_stop(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """Write-through blocks committed while the tier is skipped (an outage a moment
    ago, ``remote.unhealthy_seconds`` not over) are held to be sent later; a clean stop
    dropped them, unlogged, though the remote store answered again: only DRAM held them
    (no SSD tier), so they were lost for every daemon of the store.  Measured before: 0
    of the 24 blocks of 6 chains in Redis after the stop (the 4 chains put once it was
    back, the one put while it was down, and the one the restarted store lost), nothing
    logged; now 24 of 24."""
    redis = fresh_redis_server
    d = daemon_factory(extra=["--remote", redis.url, "--remote-write-policy", "write-through"],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "1",
                            "KVSTORE_REMOTE_UNHEALTHY_SECONDS": "600"})
    chains: list[list[bytes]] = []
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        chains.append(put_chain(ns, 0))
        wait_for(lambda: c.stats()["remote"]["writes"] == CHAIN, "the first chain never went")
        redis.kill()
        chains.append(put_chain(ns, 1))  # its send is refused: the tier is skipped
        wait_for(lambda: not c.stats()["remote"]["healthy"], "the outage was never noticed")
        redis.start()  # back, empty; the daemon skips it for 600 s
        for i in range(2, 6):
            chains.append(put_chain(ns, i))
        wait_for(lambda: c.stats()["remote"]["deferred_writes"] >= 5 * CHAIN,
                 "the blocks put since the outage were not held back")
        assert not c.stats()["remote"]["healthy"]
    d.stop()
    found = [in_redis(redis, keys) for keys in chains]
    assert found == [CHAIN] * len(chains), (found, d.log()[-2000:])


def test_values_that_expire_are_refused_under_write_back(tmp_path: Path,
                                                         redis_server: RedisServer) -> None:
    """Under write-back DRAM lets a block the remote store holds go without writing it
    back; with ``options = {ttl_s = N}`` the store had often expired it by then.
    Measured before (ttl_s 2, a 4 MiB DRAM, a real redis-server): a chain written back,
    read again and read every second for 5 s was in Redis 0 of 4 blocks, and once DRAM
    evicted it, cached nowhere ("4 blocks are cached neither here nor remotely"): lost
    while in use, silently.  Now such a configuration is refused at start, saying why."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[remote]\nurl = "{redis_server.url}"\nwrite_policy = "write-back"\n'
                      f'options = {{ttl_s = 2}}\n')
    checked = subprocess.run([sys.executable, "-m", "kvstore", "config", "check", str(config)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode != 0 and "remote.options.ttl_s" in checked.stderr, checked
    served = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config), "--endpoint",
         f"ipc://{tmp_path / 'kv.sock'}", "--ssd-capacity", "0", "--dram-capacity", "16MiB"],
        capture_output=True, text=True, timeout=60)
    assert served.returncode == 2 and "write-through" in served.stderr, served
    assert "Traceback" not in served.stderr, served.stderr
    # write-through takes it: each block goes as it commits, and none is dropped for it
    config.write_text(f'[remote]\nurl = "{redis_server.url}"\nwrite_policy = "write-through"\n'
                      f'options = {{ttl_s = 2}}\n')
    checked = subprocess.run([sys.executable, "-m", "kvstore", "config", "check", str(config)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked


@pytest.mark.parametrize("login, told", [
    ("", "the server asks for a password and the URL gives none"),
    (":wrong@", "the server refused the URL's user name or password"),
])
def test_a_store_refusing_the_login_says_what_to_change(
        daemon_factory: Any, fresh_redis_server: RedisServer, login: str, told: str) -> None:
    """A Redis that requires a password, and a URL without one: the daemon's log said
    "HELLO must be called with the client already authenticated, otherwise the HELLO
    AUTH <user> <pass> option can be used ..." (redis-py's handshake), and a read on the
    data path "GET failed: NOAUTH Authentication required." with no store named; neither
    says the URL lacks the password.  Now both say what to change; the local tiers and
    another tenant's requests are served meanwhile."""
    redis = fresh_redis_server
    redis.client().config_set("requirepass", "sekrit")
    url = redis.url.replace("redis://", f"redis://{login}")
    d = daemon_factory(extra=["--remote", url], env={"KVSTORE_REMOTE_TIMEOUT_S": "1"})
    with Client(d.endpoint, tenant="acme") as c, Client(d.endpoint, tenant="other") as o:
        ns = c.namespace(IDENT)
        keys = put_chain(ns, 0)
        wait_for(lambda: not c.stats()["remote"]["healthy"], "the refusal was never noticed")
        assert ns.lookup(keys).blocks == CHAIN  # from DRAM
        o.ping()
        stranger = ns.keys(range(90_000, 90_000 + IDENT.block_tokens))
        assert ns.lookup(stranger).blocks == 0
    d.stop()
    log = d.log()
    assert told in log, log
    assert "sekrit" not in log and "wrong" not in log.replace(told, ""), log
