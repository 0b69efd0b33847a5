"""What an operator meets running the daemon: the SSD tier's directory removed under a
daemon holding thousands of SSD copies.  Their drop goes a slice a loop turn (before:
one walk of every block, seconds at a few hundred thousand), and meanwhile every read
is bit-exact and the invariants hold (checked after each request)."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from daemon_proc import DaemonProcess, error_records
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(head_dim=16)  # 4 KiB blocks


def _content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def test_a_lost_ssd_tier_of_thousands_of_copies_goes_in_slices(tmp_path: Path) -> None:
    """9k SSD copies (4 MiB of DRAM over 64 MiB of SSD, 4 KiB blocks): after ``rm -rf``
    the drop takes more than one slice (``ssd_io.lost_slices``; before, there was one
    walk and no such figure), reads meanwhile are bit-exact or misses, and the tier
    ends empty with the daemon serving on and stopping cleanly."""
    d = DaemonProcess(tmp_path / "daemon", dram_capacity="4MiB",
                      extra=["--ssd-capacity", "64MiB", "--slab-size", "1MiB",
                             "--ssd-write-policy", "write-back"]).start()
    try:
        with Client(d.endpoint, tenant=IDENT.tenant) as c:
            ns = c.namespace(IDENT)
            chains = []
            for chain in range(80):
                keys = ns.keys(list(range(chain * 10_000, chain * 10_000 + 128 * 16)))
                ns.put(keys, [_content(k, ns.block_bytes) for k in keys])
                chains.append(keys)
            before = c.stats()
            assert before["tiers"]["ssd"]["blocks"] > 8000, before["tiers"]["ssd"]
            shutil.rmtree(d.workdir / "ssd")
            deadline = time.monotonic() + 10
            stats = c.stats()
            while stats["ssd_io"].get("lost_dropping", 1) and time.monotonic() < deadline:
                for keys in chains[::8]:  # reads while the drop goes on: exact or a miss
                    hit = ns.lookup(keys).blocks
                    if not hit:
                        continue
                    try:  # a lookup pins nothing: the drop may take a block before the get
                        got = ns.get(keys[:hit])
                    except NotFoundError:
                        continue
                    assert got == [_content(k, ns.block_bytes) for k in keys[:hit]]
                stats = c.stats()
            assert stats["ssd_io"]["healthy"] == 0, stats["ssd_io"]
            assert stats["ssd_io"]["lost_dropping"] == 0, stats["ssd_io"]
            assert stats["ssd_io"]["lost_slices"] >= 2, stats["ssd_io"]
            assert stats["tiers"]["ssd"]["blocks"] == 0, stats["tiers"]["ssd"]
            served = sum(ns.lookup(keys).blocks for keys in chains)
            assert 0 < served <= 1024  # what DRAM holds, served on
        assert d.alive()
    finally:
        assert d.stop() == 0
    assert not [e for e in error_records(d.log()) if "removed" not in e], d.log()
