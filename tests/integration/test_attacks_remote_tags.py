"""Whoever can write to the shared Redis could plant a block for any namespace: a value
with a well-formed header (an unkeyed xxh3 tag over names anyone can compute) was taken
by every daemon.  With ``remote.tag_secret_file`` shared by the daemons, values are
tagged by HMAC-SHA256 keyed with the secret over name, checksum and payload, and a
planted one is a miss."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore.errors import NotFoundError
from kvstore.plugins.codec import encode_value

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB


def _config(tmp_path: Path, secret_hex: str) -> str:
    secret = tmp_path / "tags.secret"
    secret.write_text(secret_hex + "\n")
    secret.chmod(0o600)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[remote]\ntag_secret_file = "{secret}"\n')
    return str(config)


def _written(c: Client, count: int) -> None:
    """Wait for the write-through of ``count`` blocks: a plant must come after it."""
    deadline = time.monotonic() + 10
    while c.stats()["remote"]["writes"] < count:
        assert time.monotonic() < deadline, "no write-through"
        time.sleep(0.02)


def test_a_planted_value_is_a_miss_to_daemons_with_the_secret(
        redis_server: RedisServer, daemon_factory: Any, tmp_path: Path) -> None:
    config = _config(tmp_path, os.urandom(32).hex())
    extra = ["--remote", redis_server.url, "--config", config]
    a = daemon_factory(extra=extra)
    good = b"\x21" * IDENT.block_bytes
    base = 11 << 20
    with Client(a.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(base, base + IDENT.block_tokens * 2))
        ns.put(keys[:1], [good])
        _written(c, 1)
        namespace_id = ns.id
    with redis_server.client() as r:             # the writer without the secret
        r.set(b"kvstore:" + namespace_id + keys[0],
              encode_value(namespace_id, keys[0], b"\x66" * IDENT.block_bytes))
        r.set(b"kvstore:" + namespace_id + keys[1],
              encode_value(namespace_id, keys[1], b"\x66" * IDENT.block_bytes))
    a.stop()                                     # a's DRAM copy gone: reads go remote
    b = daemon_factory(extra=extra)
    with Client(b.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        with pytest.raises(NotFoundError):
            ns.get(keys[:1])                    # overwritten by the planter: a miss
        with pytest.raises(NotFoundError):
            ns.get(keys[1:2])
    a.start()
    with Client(a.endpoint, tenant="acme") as c:  # a's own value, once more
        ns = c.namespace(IDENT)
        ns.put(keys[:1], [good])
        _written(c, 1)
    a.stop()
    with Client(b.endpoint, tenant="acme") as c:
        assert c.namespace(IDENT).get(keys[:1]) == [good]


def test_a_bad_tag_secret_file_is_a_clear_refusal(tmp_path: Path) -> None:
    import subprocess
    import sys

    for secret_hex, message in (("not hex", "hex secret"), ("ab" * 8, "holds 8 bytes")):
        config = _config(tmp_path, secret_hex)
        done = subprocess.run(
            [sys.executable, "-m", "kvstore", "serve", "--config", config,
             "--endpoint", f"ipc://{tmp_path / 'k.sock'}", "--remote", "memory://"],
            capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"remote.tag_secret_file: {tmp_path / 'tags.secret'}" in done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
