"""Opening the tier: clear errors for bad directories, sizes and layouts."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ssd_helpers import MiB, StoreFactory, chain, read_ok, write
from kvstore.errors import ConfigError


def test_directory_under_a_file_cannot_be_created(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    path = tmp_path / "a-file" / "ssd"
    with pytest.raises(ConfigError, match=f"{path} cannot be created"):
        open_store(path)


def test_read_only_directory_is_refused(open_store: StoreFactory, tmp_path: Path) -> None:
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        with pytest.raises(ConfigError, match=f"{path} is not writable"):
            open_store(path)
        return
    # root ignores file modes; a read-only mount stops it
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail("running as root without mount rights: no way to make a directory "
                    "read-only for this test")
    try:
        with pytest.raises(ConfigError, match=f"{path} is not writable"):
            open_store(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_capacity_beyond_free_space_names_path_and_size(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    fs = os.statvfs(tmp_path)
    slab = 64 * MiB
    capacity = (fs.f_bavail * fs.f_frsize // slab + 16) * slab
    path = tmp_path / "ssd"
    with pytest.raises(ConfigError, match=f"{path} has \\d+ bytes free.*capacity_bytes={capacity}"):
        open_store(path, capacity, slab_bytes=slab)
    assert not (path / "blocks.dat").exists() and not (path / "index").exists()


@pytest.mark.parametrize(
    ("capacity", "slab", "field"),
    [(64 * MiB, 8 * MiB + 1, "slab_bytes"), (64 * MiB + 4096, 8 * MiB, "capacity_bytes"),
     (0, 8 * MiB, "capacity_bytes")],
)
def test_bad_sizes(open_store: StoreFactory, capacity: int, slab: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        open_store(capacity=capacity, slab_bytes=slab)


def test_bad_sync_policy(open_store: StoreFactory) -> None:
    with pytest.raises(ConfigError, match="sync='sometimes'"):
        open_store(sync="sometimes")


@pytest.mark.parametrize(
    ("capacity", "slab", "message"),
    [
        (128 * MiB, 8 * MiB, "capacity_bytes=67108864 \\(config: 134217728\\)"),
        (64 * MiB, 16 * MiB, "slab_bytes=8388608 \\(config: 16777216\\)"),
    ],
)
def test_layout_mismatch_on_reopen(
    open_store: StoreFactory, capacity: int, slab: int, message: str
) -> None:
    store = open_store()
    records = write(store, chain(os.urandom(16), 2, 4096, 0))
    store.close()
    with pytest.raises(ConfigError, match=message):
        open_store(capacity=capacity, slab_bytes=slab)
    # the refused open touched nothing
    reopened = open_store()
    assert all(read_ok(reopened, r) for r in reopened.load())
    assert len(records) == reopened.stats()["records"]


def test_directory_held_by_another_store(open_store: StoreFactory) -> None:
    """Refused, naming the process that holds it (its lock file says; before, the
    error named none, and an operator had to look for it)."""
    open_store()
    held = rf"in use by another kvstore process \(pid {os.getpid()}\)"
    with pytest.raises(ConfigError, match=held):
        open_store()


@pytest.mark.parametrize("damage", ["data file a directory", "data file /dev/zero",
                                    "index a file", "index data a directory"])
def test_files_that_cannot_be_opened_are_a_config_error(
    open_store: StoreFactory, tmp_path: Path, damage: str
) -> None:
    # (an OSError went up from the open: the daemon died with a traceback, exit 1)
    path = tmp_path / "ssd"
    open_store(path).close()
    target = {"data file a directory": path / "blocks.dat",
              "data file /dev/zero": path / "blocks.dat",
              "index a file": path / "index",
              "index data a directory": path / "index" / "data.mdb"}[damage]
    aside = tmp_path / "aside"
    target.rename(aside)
    if damage == "data file /dev/zero":
        target.symlink_to("/dev/zero")
    elif damage == "index a file":
        target.write_bytes(b"junk")
    else:
        target.mkdir()
    with pytest.raises(ConfigError, match=f"{path}: a file cannot be opened .*start the tier cold"):
        open_store(path)
    # the refused open let the directory go again
    (target.unlink if target.is_symlink() or target.is_file() else target.rmdir)()
    aside.rename(target)
    open_store(path).close()


def test_preallocation_reserves_the_capacity(open_store: StoreFactory, tmp_path: Path) -> None:
    open_store(capacity=32 * MiB, preallocate=True)
    assert os.stat(tmp_path / "ssd" / "blocks.dat").st_blocks * 512 >= 32 * MiB


def test_lazy_allocation_reserves_slabs_on_first_write(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    store = open_store(capacity=32 * MiB, preallocate=False)
    data = tmp_path / "ssd" / "blocks.dat"
    assert os.stat(data).st_size == 32 * MiB and os.stat(data).st_blocks == 0
    write(store, chain(os.urandom(16), 1, 4096, 8 * MiB))
    assert 8 * MiB <= os.stat(data).st_blocks * 512 < 16 * MiB


def test_the_index_has_room_for_a_record_per_4k_slot(tmp_path: Path) -> None:
    from kvstore.tiers.ssd import SSDStore

    capacity = 16 << 30  # sparse: nothing is preallocated
    if os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize < capacity:
        pytest.skip("the free-space check needs the capacity free on this disk")
    with SSDStore(tmp_path / "ssd", capacity, slab_bytes=64 << 20, direct_io=False,
                  preallocate=False) as store:
        index = store._directory.parts()[1]  # type: ignore[union-attr]
        # about 330 bytes a record, measured: 3M records filled a 1 GiB map
        assert index._env.info()["map_size"] >= capacity // 4096 * 400


def test_a_lock_file_that_cannot_take_the_pid_still_locks(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pid written into the lock file only names the holder: a disk too full to take
    it (ENOSPC) refused the tier's start before ("cannot hold a lock file").  Now the
    store opens, holds the lock all the same, and serves."""
    pid_line = f"{os.getpid()}\n".encode()
    real_pwrite = os.pwrite

    def full_disk(fd: int, data: Any, offset: int) -> int:
        if bytes(data) == pid_line:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    store = open_store()
    records = write(store, chain(os.urandom(16), 2, 4096, 0))
    assert all(read_ok(store, r) for r in records)
    with pytest.raises(ConfigError, match="in use by another kvstore process"):
        open_store()
