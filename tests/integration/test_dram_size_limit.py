"""A daemon started under a file size limit (``ulimit -f``, ``LimitFSIZE=`` in its
unit) below its DRAM arena: the refusal names the limit.  Before, it said "dram.capacity:
cannot allocate 67108864 bytes in /dev/shm: File too large", with no word of the limit
(the arena is a file, and the limit bounds it as any other)."""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_proc import DaemonProcess, refused_under_file_size_limit

MiB = 1 << 20


@pytest.mark.parametrize("arena_kind", ["memfd", "file"])
def test_a_file_size_limit_below_the_arena_is_named(tmp_path: Path, arena_kind: str) -> None:
    d = DaemonProcess(tmp_path / "daemon", dram_capacity="64MiB",
                      env={"KVSTORE_DRAM_ARENA_KIND": arena_kind})
    message = refused_under_file_size_limit(d, 8 * MiB)
    assert "dram.capacity" in message and "file size limit" in message, message
    assert str(8 * MiB) in message, message
