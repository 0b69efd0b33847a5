"""A SIGKILL in the middle of heavy writes never leaves a visible block with bad bytes."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ssd_helpers import StoreFactory, read_ok
from ssd_crash_writer import CAPACITY, CHAIN, GROUPS, SLAB

WRITER = Path(__file__).with_name("ssd_crash_writer.py")


def write_until_killed(path: Path, sync: str, direct_io: bool, batches: int) -> int:
    """Run the writer until it has committed ``batches`` batches, then SIGKILL it mid-batch."""
    child = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), sync, "1" if direct_io else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        done = 0
        deadline = time.monotonic() + 60
        while done < batches and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            done = int(line)
        time.sleep(random.uniform(0, 0.01))
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        _, err = child.communicate()
        assert child.stdout is not None and child.stderr is not None
    assert child.returncode == -signal.SIGKILL, err
    assert done >= batches, f"writer stopped after {done} batches: {err}"
    return done


@pytest.mark.parametrize(("sync", "direct_io"), [("batch", True), ("none", False)])
def test_sigkill_during_writes_leaves_only_good_blocks(
    open_store: StoreFactory, tmp_path: Path, sync: str, direct_io: bool
) -> None:
    path = tmp_path / "ssd"
    for round_ in range(3):
        # later rounds wrap around the slots, so removals and rewrites are in flight too
        done = write_until_killed(path, sync, direct_io, batches=10 + 25 * round_)
        store = open_store(path, CAPACITY, slab_bytes=SLAB, sync=sync, direct_io=direct_io)
        survivors = store.load()
        # a process crash loses nothing committed; only the chain being replaced may be gone
        assert len(survivors) >= (min(done, GROUPS) - 1) * CHAIN
        assert all(read_ok(store, record) for record in survivors)
        assert store.stats()["checksum_failures"] == 0
        store.close()
