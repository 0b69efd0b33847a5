"""Each client connection is a descriptor, and at the limit on open files ZeroMQ 4.3
aborts the process in an ipc socket's accept: a peer that opened plain connections past
a shell's soft limit, sending nothing, killed the daemon (exit by SIGABRT, its arena
left in /dev/shm).  The daemon raises its soft limit to the hard one at start."""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from kvstore import Client

SOFT = 256


def limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files line")


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * SOFT,
                    reason="a hard limit on open files too low to raise past the soft one")
def test_plain_connections_past_a_low_soft_limit_do_not_kill_the_daemon(
        tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))
    try:  # the daemon is started under the low soft limit
        daemon = DaemonProcess(tmp_path, dram_capacity="8MiB").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    peers: list[socket.socket] = []
    try:
        assert daemon.proc is not None
        assert limits(daemon.proc.pid) == (hard, hard)
        path = daemon.endpoint[len("ipc://"):]
        for _ in range(SOFT + 100):  # past the soft limit it was started with
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peers.append(peer)
            peer.connect(path)
        time.sleep(1)
        assert daemon.alive()
        with Client(daemon.endpoint, tenant="acme", timeout=10) as client:
            assert client.stats()["invariant_violations"] == 0
    finally:
        for peer in peers:
            peer.close()
        daemon.stop()
