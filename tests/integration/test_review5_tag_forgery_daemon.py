"""End to end, through two daemons sharing a Redis with a tag secret: a writer without the
secret keeps a block's stored header and swaps its payload for chosen bytes with the same
xxh3_64 (``xxh3_forge``).  The keyed tag covered the checksum alone, and the second
daemon served the swapped bytes as the block; it covers the payload now: a miss."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from redis_servers import RedisServer
from xxh3_forge import forge_xxh3

from kvstore import Client
from kvstore.errors import NotFoundError
from kvstore.plugins.codec import HEADER_BYTES

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB


def test_a_payload_of_the_same_xxh3_is_a_miss_to_daemons_with_the_secret(
        redis_server: RedisServer, daemon_factory: Any, tmp_path: Path) -> None:
    secret = tmp_path / "tags.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[remote]\ntag_secret_file = "{secret}"\n')
    extra = ["--remote", redis_server.url, "--config", str(config)]
    a = daemon_factory(extra=extra)
    good = random.Random(3).randbytes(IDENT.block_bytes)
    with Client(a.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(23 << 20, (23 << 20) + IDENT.block_tokens))
        ns.put(keys, [good])
        namespace_id = ns.id
    a.stop()                                       # a's DRAM copy gone: reads go remote
    name = b"kvstore:" + namespace_id + keys[0]
    with redis_server.client() as r:               # the writer without the secret
        stored = r.get(name)
        assert stored is not None and stored[HEADER_BYTES:] == good
        r.set(name, stored[:HEADER_BYTES] + forge_xxh3(good, random.Random(4)))
    b = daemon_factory(extra=extra)
    with Client(b.endpoint, tenant="acme", checksums=True) as c:
        with pytest.raises(NotFoundError):
            c.namespace(IDENT).get(keys)
        assert c.stats()["remote"]["corrupt_values"] == 1
