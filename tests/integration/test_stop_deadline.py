"""A stop that cannot finish ends all the same: at ``server.stop_seconds`` from the
signal, or at once on a second signal, with what it was doing logged and told to
systemd; and what reached the SSD tier before is restored at the next start.

A real daemon whose SSD writes stall (``tests/stalled_disk.py``: its ``pwritev`` waits
while a flag file exists, as a write to a disk that stopped answering never returns).
Before, the stop wrote back what only DRAM held, gave up after 30 s, and then waited
forever for the stalled write (the SSD tier's thread pool, and the interpreter's exit,
wait for their threads): the daemon never exited.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import NotFoundError

IDENT = make_identity(head_dim=256)  # 64 KiB blocks
CHAINS = 12
CHAIN = 8  # blocks a chain: 12 chains of 512 KiB, past the 4 MiB of DRAM
WRAPPER = Path(__file__).resolve().parents[1] / "stalled_disk.py"


def content(i: int, j: int) -> bytes:
    return bytes([i, j]) * (IDENT.block_bytes // 2)


def chain_keys(ns: object, i: int) -> list[bytes]:
    return ns.keys(range(i * 1000, i * 1000 + CHAIN * IDENT.block_tokens))  # type: ignore


def stalled_daemon(work: Path, flag: Path, **env: str) -> DaemonProcess:
    d = DaemonProcess(work, dram_capacity="4MiB", ssd_capacity="64MiB",
                      extra=["--log-level", "info"], debug_invariants=False,
                      env={"STALL_FLAG": str(flag), **env})
    d.run_through(WRAPPER)
    return d.start()


def fill(d: DaemonProcess) -> None:
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        for i in range(CHAINS):
            keys = chain_keys(ns, i)
            ns.put(keys, [content(i, j) for j in range(CHAIN)])
        assert c.stats()["tiers"]["ssd"]["committed_slots"] > 0  # some went down to SSD


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    try:
        yield sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            return out


def test_a_stop_stuck_on_a_stalled_disk_ends_at_its_deadline(
        tmp_path: Path, systemd_socket: socket.socket) -> None:
    flag = tmp_path / "stall"
    d = stalled_daemon(tmp_path / "d", flag, KVSTORE_SERVER_STOP_SECONDS="4",
                       NOTIFY_SOCKET=str(tmp_path / "notify"))
    try:
        fill(d)
        flag.touch()  # the disk stops answering
        assert d.proc is not None
        began = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the daemon did not exit within 30 s of SIGTERM with a stop "
                        "deadline of 4 s")
        took = time.monotonic() - began
    finally:
        flag.unlink(missing_ok=True)
        d.stop()
    log = d.log()
    assert code == 1, log[-2000:]
    assert took >= 3.5, took  # the stop had its time: the deadline, not at once
    assert "the stop took longer than server.stop_seconds (4 s)" in log, log[-2000:]
    assert "still closing the tiers" in log or "still writing" in log, log[-2000:]
    statuses = [m for m in received(systemd_socket) if "STATUS=stopping" in m]
    assert any("STATUS=stopping: writing the blocks only dram holds to the ssd tier" in m
               for m in statuses), statuses
    # what reached the SSD tier before the disk stalled is there after the forced exit;
    # nothing else is served, and nothing wrong
    again = DaemonProcess(tmp_path / "d", dram_capacity="4MiB", ssd_capacity="64MiB").start()
    try:
        with Client(again.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            restored = 0
            for i in range(CHAINS):
                keys = chain_keys(ns, i)
                hits = ns.lookup(keys).blocks
                restored += hits
                if hits:
                    assert ns.get(keys[:hits]) == [content(i, j) for j in range(hits)]
                if hits < CHAIN:
                    with pytest.raises(NotFoundError):
                        ns.get(keys[hits:hits + 1])
            assert restored > 0
    finally:
        again.stop()


def test_a_second_signal_ends_a_stuck_stop_at_once(tmp_path: Path) -> None:
    flag = tmp_path / "stall"
    d = stalled_daemon(tmp_path / "d", flag, KVSTORE_SERVER_STOP_SECONDS="0")  # no limit
    try:
        fill(d)
        flag.touch()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)
        assert d.proc.poll() is None  # stuck writing back what only DRAM holds
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail("a second SIGTERM did not end the stuck stop within 10 s")
    finally:
        flag.unlink(missing_ok=True)
        d.stop()
    log = d.log()
    assert code == 1, log[-2000:]
    assert ("a second stop signal came while writing the blocks only dram holds to the "
            "ssd tier: exiting now") in log, log[-2000:]


def test_the_stop_deadline_is_checked() -> None:
    for bad in ("-1", "0.5", "nan", "100000"):
        proc = subprocess.run([sys.executable, "-m", "kvstore", "config", "check"],
                              capture_output=True, text=True, timeout=60,
                              env={"KVSTORE_SERVER_STOP_SECONDS": bad, "PATH": "/usr/bin"})
        assert proc.returncode != 0
        assert "server.stop_seconds: " in proc.stderr, proc.stderr
