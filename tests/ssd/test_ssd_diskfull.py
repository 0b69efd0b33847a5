"""A full disk is a typed error; earlier blocks stay readable; failed blocks get no record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssd_helpers import KiB, StoreFactory, chain, read_ok, run, write
from kvstore.errors import CapacityError

FSIZE_WRITER = Path(__file__).with_name("ssd_fsize_writer.py")


def test_enospc_on_a_full_filesystem(open_store: StoreFactory, small_tmpfs: Path) -> None:
    store = open_store(
        small_tmpfs / "ssd", 2048 * KiB, slab_bytes=512 * KiB, preallocate=False
    )
    namespace = os.urandom(16)
    earlier = write(store, chain(namespace, 2, 256 * KiB, 0))
    fs = os.statvfs(small_tmpfs)
    # leave room for index pages, not for another slab
    (small_tmpfs / "filler").write_bytes(bytes(fs.f_bavail * fs.f_frsize - 128 * KiB))

    failed = chain(namespace, 2, 256 * KiB, 512 * KiB)
    with pytest.raises(CapacityError, match="disk full"):
        write(store, failed)

    assert all(read_ok(store, r) for r in earlier)
    assert all(store.lookup((namespace, r.key)) is None for r in failed)
    assert store.stats()["records"] == 2 and store.stats()["writes"] == 2
    # space comes back: the tier works again
    (small_tmpfs / "filler").unlink()
    assert all(read_ok(store, r) for r in write(store, failed))


def test_efbig_under_a_file_size_limit(open_store: StoreFactory, tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    result = subprocess.run(
        [sys.executable, str(FSIZE_WRITER), str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert "disk full" in outcome["error"] and "File too large" in outcome["error"]

    store = open_store(path, 8 << 20, slab_bytes=2 << 20, preallocate=False)
    namespace = bytes.fromhex(outcome["namespace"])
    survivors = store.load()
    assert [r.key.hex() for r in survivors] == [outcome["first"]]
    buffer = bytearray(survivors[0].length)
    assert run(store.read_into(survivors[0], buffer))
    for key in outcome["failed"]:
        assert store.lookup((namespace, bytes.fromhex(key))) is None


def test_full_disk_at_index_commit_publishes_nothing(
    open_store: StoreFactory, small_tmpfs: Path
) -> None:
    store = open_store(small_tmpfs / "ssd", 1024 * KiB, slab_bytes=512 * KiB, preallocate=True)
    namespace = os.urandom(16)
    earlier = write(store, chain(namespace, 1, 4096, 0))
    fs = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(bytes(fs.f_bavail * fs.f_frsize))

    # the data slab is preallocated, so the bytes go down; the index cannot grow
    failed = chain(namespace, 200, 4096, 8192)
    with pytest.raises(CapacityError, match="disk full under SSD index"):
        write(store, failed)

    assert all(read_ok(store, r) for r in earlier)
    assert all(store.lookup((namespace, r.key)) is None for r in failed)
    assert store.stats()["records"] == 1
    (small_tmpfs / "filler").unlink()
