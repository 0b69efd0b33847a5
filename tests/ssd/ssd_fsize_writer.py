"""Child process for the disk-full test: hits RLIMIT_FSIZE (EFBIG) in the middle of a run.

Usage: python ssd_fsize_writer.py DIR

Writes one block, lowers RLIMIT_FSIZE below the next block's offset (SIGXFSZ ignored, so
the write fails with EFBIG), tries a batch there, and prints the outcome as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path

from kvstore.errors import CapacityError
from kvstore.tiers.ssd import BlockRecord, SSDStore

MiB = 1 << 20


async def main(path: Path) -> None:
    store = SSDStore(path, 8 * MiB, slab_bytes=2 * MiB, preallocate=False)
    namespace = os.urandom(16)
    first = BlockRecord(namespace, os.urandom(16), None, 0, MiB)
    await store.write_blocks([first], [os.urandom(MiB)])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * MiB, resource.RLIM_INFINITY))
    # the first block fits under the limit, the second crosses it
    failed = [
        BlockRecord(namespace, os.urandom(16), first.key, 2 * MiB, MiB),
        BlockRecord(namespace, os.urandom(16), None, 3 * MiB, MiB),
    ]
    outcome = {"first": first.key.hex(), "failed": [r.key.hex() for r in failed]}
    try:
        await store.write_blocks(failed, [os.urandom(MiB) for _ in failed])
    except CapacityError as exc:
        outcome["error"] = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    store.close()
    print(json.dumps({**outcome, "namespace": namespace.hex()}))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
