"""A peer without credentials on a gated endpoint: ZeroMQ reads each handshake frame
whole (up to the limit every frame has, ``max_request_bytes``) before the credentials in
it are checked, so what such a peer sends of one big frame is held by the daemon until
the connection closes.  ``server.handshake_seconds`` closes it (ZeroMQ's default, 30 s,
let two such peers hold 400 MiB for half a minute, and a peer that reconnected, for
ever)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess


def plain_greeting() -> bytes:
    """ZMTP 3.0's greeting, naming the PLAIN mechanism, as a client's."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"PLAIN".ljust(20, b"\0") \
        + b"\0" + b"\0" * 31


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmRSS"))


def test_a_handshake_frame_without_credentials_is_held_for_the_handshake_bound_only(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nhandshake_seconds = 1.0\n[auth]\nsecret_file = "{secret}"\n')
    daemon: DaemonProcess = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert daemon.tcp_endpoint is not None and daemon.proc is not None
    host, port = daemon.tcp_endpoint[len("tcp://"):].rsplit(":", 1)
    before = rss_kib(daemon.proc.pid)
    with socket.create_connection((host, int(port)), timeout=10) as peer:
        peer.sendall(plain_greeting())
        # a command frame (flags COMMAND | LONG) of 65 MiB, of which 64 are sent
        peer.sendall(b"\x06" + struct.pack(">Q", 65 << 20))
        chunk = bytes(1 << 20)
        for _ in range(64):
            peer.sendall(chunk)
        start = time.monotonic()
        held = rss_kib(daemon.proc.pid) - before
        assert held > 32 << 10, held  # what it sent is in the daemon: ZeroMQ's buffer
        # ... until the handshake's bound closes the connection
        peer.settimeout(10)
        while peer.recv(65536):  # (the daemon's greeting, then end of file)
            pass
        waited = time.monotonic() - start
    assert waited < 5, waited  # 1 s, where ZeroMQ's default waits 30
    time.sleep(0.5)
    assert rss_kib(daemon.proc.pid) - before < 16 << 10  # given back
    assert daemon.alive()
