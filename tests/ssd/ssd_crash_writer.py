"""Child process for the crash tests: writes key chains into an SSD store until killed.

Usage: python ssd_crash_writer.py DIR SYNC DIRECT_IO

Slots are reused in groups; the old chain in a group is removed before the group is
rewritten, as the daemon does.  Prints the number of committed batches after each one.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import cast

import numpy as np

from kvstore.tiers.ssd import BlockRecord, SSDStore, SyncPolicy

BLOCK = 256 << 10
CHAIN = 8
GROUPS = 24
CAPACITY = GROUPS * CHAIN * BLOCK
SLAB = CHAIN * BLOCK


def block_bytes(key: bytes, length: int) -> bytes:
    """Same derivation as ssd_helpers.block_bytes."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(length)


async def main(path: Path, sync: str, direct_io: bool) -> None:
    store = SSDStore(
        path, CAPACITY, slab_bytes=SLAB, sync=cast(SyncPolicy, sync), direct_io=direct_io
    )
    namespace = os.urandom(16)
    in_group: dict[int, list[BlockRecord]] = {}
    for record in store.load():  # what an earlier (killed) writer left
        in_group.setdefault(record.offset // SLAB, []).append(record)
    batch = 0
    while True:
        group = batch % GROUPS
        if group in in_group:
            await store.remove([(r.namespace, r.key) for r in in_group.pop(group)])
        parent: bytes | None = None
        records: list[BlockRecord] = []
        for i in range(CHAIN):
            key = os.urandom(16)
            records.append(BlockRecord(namespace, key, parent, group * SLAB + i * BLOCK, BLOCK))
            parent = key
        in_group[group] = await store.write_blocks(
            records, [block_bytes(r.key, r.length) for r in records]
        )
        batch += 1
        print(batch, flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"))
