"""``python tests/racing_writer.py serve ...``: the daemon, and another writer of its Redis
remote store racing it: right after the daemon's first read that misses a value (missing
or corrupt), the values in the JSON file ``$RACE_VALUES`` (``{"url": ..., "values":
{hex Redis key: hex value}}``) are written there, as another daemon's writes landing
between that read and what the daemon does next."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import redis

from kvstore.plugins.redis_backend import RedisBackend

_get_into_checksums = RedisBackend.get_into_checksums
_raced = False


async def _racing_get(self: RedisBackend, namespace: bytes, keys: Sequence[bytes],
                      buffers: Sequence[memoryview]) -> list[int | None]:
    global _raced
    sums = await _get_into_checksums(self, namespace, keys, buffers)
    if None in sums and not _raced:
        _raced = True
        with open(os.environ["RACE_VALUES"]) as f:
            race = json.load(f)
        client = redis.Redis.from_url(race["url"])
        for name, value in race["values"].items():
            client.set(bytes.fromhex(name), bytes.fromhex(value))
        client.close()
    return sums


RedisBackend.get_into_checksums = _racing_get  # type: ignore[method-assign]

if __name__ == "__main__":
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
