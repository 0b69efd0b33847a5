"""Frames puts do not fault their receive buffers in anew each time: ZeroMQ's I/O thread
in the daemon reads every large frame into a buffer of its own, freed once the bytes are
in the arena, and the allocator keeps those pages for the next put rather than hand them
back to the kernel (``kvstore.transport.keep_receive_buffers``).  Counted, not timed:
the minor page faults of the daemon's ZeroMQ I/O thread over a run of puts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client

# 16 blocks of 256 KiB a put: 4 MiB, 1024 pages of 4 KiB
BLOCKS = make_identity(model="receive-faults", num_layers=16, num_kv_heads=4,
                       head_dim=128, block_tokens=8)
PUTS = 8
WARM = 8


def _io_thread_faults(pid: int) -> int:
    """Minor faults of the process's ZeroMQ I/O threads so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = Path(f"/proc/{pid}/task/{tid}")
        if task.joinpath("comm").read_text().startswith("ZMQbg/IO"):
            total += int(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[7])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_puts_reuse_the_receive_buffers_of_the_puts_before(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="256MiB")
    assert d.proc is not None
    with Client(d.endpoint, tenant="acme", map_arena=False) as c:
        ns = c.namespace(BLOCKS)
        assert ns.block_bytes == 256 << 10
        blocks = [os.urandom(ns.block_bytes) for _ in range(16)]
        chains = [ns.keys(range(i * 128, (i + 1) * 128)) for i in range(WARM + PUTS)]
        for keys in chains[:WARM]:  # the buffers' first touch
            ns.put(keys, blocks)
        before = _io_thread_faults(d.proc.pid)
        for keys in chains[WARM:]:
            assert ns.put(keys, blocks) == 16
        faults = _io_thread_faults(d.proc.pid) - before
        assert ns.get(chains[-1]) == blocks
    # faulted in anew, 300-350 faults a put (of its 1024 pages); kept, 15-90 (the heap grows
    # while a put's buffers are in use as the next one arrives, the client answered)
    assert faults < 150 * PUTS, f"{faults} minor faults of the I/O thread over {PUTS} puts"
