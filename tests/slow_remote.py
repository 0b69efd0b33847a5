"""``python tests/slow_remote.py serve ...``: the daemon, its reads from the Redis
remote store held while the file ``$REMOTE_HOLD_FLAG`` exists (as a slow store's would
take a while), and its writes there too if ``$REMOTE_HOLD_WRITES`` is set;
``$REMOTE_HOLD_REACHED`` is created when one is held; ``$ROOM_COMING_WAIT``, how long
one wait for room coming lasts unless woken."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.plugins.redis_backend import RedisBackend

FLAG = os.environ["REMOTE_HOLD_FLAG"]
REACHED = os.environ["REMOTE_HOLD_REACHED"]
_get_into_checksums = RedisBackend.get_into_checksums
_put_checksummed = RedisBackend.put_checksummed


async def _held() -> None:
    while os.path.exists(FLAG):
        Path(REACHED).touch()
        await asyncio.sleep(0.02)


async def _held_get(self: RedisBackend, namespace: bytes, keys: Sequence[bytes],
                    buffers: Sequence[memoryview]) -> list[int | None]:
    await _held()
    return await _get_into_checksums(self, namespace, keys, buffers)


async def _held_put(self: RedisBackend, *args: Any, **kwargs: Any) -> Any:
    await _held()
    return await _put_checksummed(self, *args, **kwargs)


RedisBackend.get_into_checksums = _held_get  # type: ignore[method-assign]
if os.environ.get("REMOTE_HOLD_WRITES"):
    RedisBackend.put_checksummed = _held_put  # type: ignore[method-assign]
if "ROOM_COMING_WAIT" in os.environ:  # (``tests/stalled_disk.py``)
    import kvstore.moves

    kvstore.moves._ROOM_COMING_WAIT = float(os.environ["ROOM_COMING_WAIT"])

if __name__ == "__main__":
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
