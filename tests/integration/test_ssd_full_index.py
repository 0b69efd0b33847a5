"""An SSD index that cannot commit (its disk full) loses no intact block and no removal.

A real daemon with a write-through SSD tier on a 4 MiB tmpfs.  One block's bytes on disk
are flipped while it is down; after the restart the tmpfs is filled, so the index can
drop no record.  Before: the read's verdicts were lost with the failed drop, so every
block of the batch counted as corrupt and went with what hangs below it (intact blocks
0-4 of a 16-block chain dropped), and the store's dropped copies stayed in the index, a
background task's error logged by asyncio and nothing else, to come back at a restart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import error_records
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks


def content(key: bytes) -> bytes:
    return (key * (IDENT.block_bytes // len(key) + 1))[:IDENT.block_bytes]


def fill(mount: Path) -> None:
    """Take every free byte of ``mount``."""
    st = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:
        try:
            f.write(b"x" * (st.f_bavail * st.f_frsize))
            f.flush()
        except OSError:
            pass  # (full: as meant)


def test_a_full_index_drops_only_the_corrupt_block(daemon_factory: Any,
                                                   small_tmpfs: Path) -> None:
    args = dict(dram_capacity="1MiB", ssd_capacity="1MiB",
                extra=["--ssd-path", str(small_tmpfs / "ssd"), "--slab-size", "64KiB",
                       "--ssd-write-policy", "write-through"],
                env={"KVSTORE_SSD_SLAB_SIZE": "1MiB", "KVSTORE_DRAM_POPULATE": "false"})
    d = daemon_factory(**args)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(16 * IDENT.block_tokens))
        ns.put(keys, [content(k) for k in keys])
        deadline = time.monotonic() + 10
        while c.stats()["tiers"]["ssd"]["committed_slots"] < 16:
            assert time.monotonic() < deadline, "the write-through never reached SSD"
            time.sleep(0.05)
    d.stop()
    data = (small_tmpfs / "ssd" / "blocks.dat").read_bytes()
    at = data.find(content(keys[5]))
    assert at >= 0
    fd = os.open(small_tmpfs / "ssd" / "blocks.dat", os.O_RDWR)
    try:
        os.pwrite(fd, bytes([data[at + 7] ^ 0xFF]), at + 7)
    finally:
        os.close(fd)
    d.start()
    fill(small_tmpfs)
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            with pytest.raises(NotFoundError):
                ns.get(keys)  # block 5 fails its checksum: the whole get is a miss
            # the intact blocks before it stay, and are served as they were written
            assert ns.lookup(keys).blocks == 5
            assert ns.get(keys[:5]) == [content(k) for k in keys[:5]]
            stats = c.stats()
            assert stats["tiers"]["ssd"]["checksum_failures"] == 1
    finally:
        (small_tmpfs / "filler").unlink()
    # the dropped copies' records were kept to withdraw, and go once there is room:
    # after a restart block 5 and below are not restored (their SSD copies were dropped)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        ns.put(keys[:1], [content(keys[0])])  # (a change that withdraws the waiting ones)
    d.stop()
    errors = error_records(d.log())
    assert not errors, errors
    d.start()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        assert ns.lookup(keys).blocks == 5
        assert ns.get(keys[:5]) == [content(k) for k in keys[:5]]
