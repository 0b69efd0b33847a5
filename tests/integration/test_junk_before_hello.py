"""Peers that never say hello get bounded work: a few small messages read and answered,
the rest dropped unread; large ones never decoded.  The daemon keeps serving and its
memory stays bounded while hundreds of them flood it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess
from kvtest import make_identity, wait_for_lease_end

from kvstore import Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.errors import LeaseExpiredError
from kvstore.transport import PRE_HELLO_MESSAGES

FLOOD = r"""
import os, sys, zmq
endpoint, peers, big_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(peers)]
for s in socks:
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(endpoint)
big = os.urandom(1 << 20) * big_mib
for round in range(12):
    for i, s in enumerate(socks):
        frames = ([b"\x92\xa4junk", big, big] if i % 10 == 0
                  else [os.urandom(100), os.urandom(32), os.urandom(32)])
        try:  # never blocks: a peer refused in the handshake may have no pipe at times
            s.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
for s in socks:
    s.close()
ctx.term()
print("sent", flush=True)
"""


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory (or with VmHWM, its peak so far), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def test_a_peer_without_a_session_is_answered_a_few_times_then_dropped(
        daemon: DaemonProcess) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        sock.send(p.encoder.encode(p.GpuAttach(1)))     # the GPU pool's handle, too
        assert sock.poll(10_000)
        refused = p.reply_decoder.decode(sock.recv())
        assert isinstance(refused, p.ErrorReply) and refused.code == "forbidden"
        for rid in range(2, 41):
            sock.send(p.encoder.encode(p.Stats(rid)))
        replies = []
        while sock.poll(1500):
            replies.append(p.reply_decoder.decode(sock.recv()))
        assert len(replies) == PRE_HELLO_MESSAGES - 1
        assert all(isinstance(r, p.ErrorReply) and r.code == "forbidden" for r in replies)
        sock.send_multipart([p.encoder.encode(p.Stats(99)), os.urandom(4096)])
        assert not sock.poll(500)        # a message too many, and more than a header
    finally:
        sock.close()
        ctx.term()
    with Client(daemon.endpoint, tenant="acme") as client:
        assert client.stats()["before_hello"]["dropped"] >= 40 - PRE_HELLO_MESSAGES + 1


def test_hundreds_of_junk_peers_leave_the_daemon_serving_within_bounded_memory(
        daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(64))
        ns.put(keys, [b"\1" * ns.block_bytes] * 4)
        before = rss_mib(daemon.proc.pid)
        peers, big_mib = 300, 4
        flood = subprocess.run([sys.executable, "-c", FLOOD, daemon.endpoint, str(peers),
                                str(big_mib)], capture_output=True, text=True, timeout=300)
        assert flood.stdout.strip() == "sent", flood.stderr
        sent_mib = 12 * (peers // 10) * 2 * big_mib        # 2.8 GiB of large frames
        after = rss_mib(daemon.proc.pid)
        # dropped as they come, never held: growth is far below what was sent
        assert after - before < sent_mib / 4, (before, after, sent_mib)
        client.ping()
        assert ns.get(keys) == [b"\1" * ns.block_bytes] * 4
        stats = client.stats()
        assert stats["before_hello"]["dropped"] >= peers * (12 - PRE_HELLO_MESSAGES)
        assert stats["invariant_violations"] == 0
    assert daemon.alive()


def test_a_session_that_expired_is_told_so_every_time(daemon_factory: Any) -> None:
    d = daemon_factory(lease=0.5)
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        wait_for_lease_end(d.endpoint, "acme", at_most=1.5)
        for _ in range(2 * PRE_HELLO_MESSAGES):     # more than a stranger gets answered
            with pytest.raises(LeaseExpiredError):
                ns.put(keys, [b"\1" * ns.block_bytes] * 2)


def test_with_credentials_a_peer_without_a_ticket_gets_nothing_in(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("cd" * 32)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\noperators = ["acme"]\n')
    d = daemon_factory(dram_capacity="8MiB", extra=["--config", str(config)])
    assert d.proc is not None
    before = rss_mib(d.proc.pid)
    peers, big_mib = 100, 4
    flood = subprocess.run([sys.executable, "-c", FLOOD, d.endpoint, str(peers),
                            str(big_mib)], capture_output=True, text=True, timeout=300)
    assert flood.stdout.strip() == "sent", flood.stderr
    after = rss_mib(d.proc.pid)
    assert after - before < 64, (before, after)   # nothing was read: the handshake failed
    with Client(d.endpoint, token=issue_token(read_secret(secret), "acme", 60)) as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        ns.put(keys, [b"\2" * ns.block_bytes] * 2)
        assert ns.get(keys) == [b"\2" * ns.block_bytes] * 2
        stats = client.stats()
        assert stats["before_hello"]["dropped"] == 0   # no junk ever reached the daemon
        assert stats["invariant_violations"] == 0


BIG_TCP = r"""
import os, socket, sys, time, zmq
endpoint, peers, big_mib, forged = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = zmq.Context()
socks = []
for i in range(peers):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 3000)
    if i % 2:  # half of them present a token, forged: refused in the handshake
        s.plain_username, s.plain_password = b"acme", forged.encode()
    s.connect(endpoint)
    socks.append(s)
big = os.urandom(1 << 20) * big_mib
for s in socks:
    try:
        s.send_multipart([b"\x92\xa4junk", big], zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass
# and one that speaks no ZeroMQ at all: a length that claims a huge frame, then bytes
host, port = endpoint[len("tcp://"):].rsplit(":", 1)
raw = socket.create_connection((host, int(port)))
try:
    raw.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + big[: 8 << 20])
except OSError:
    pass
raw.close()
time.sleep(2)
for s in socks:
    s.close()
ctx.term()
print("sent", flush=True)
"""


def test_over_tcp_with_a_token_secret_a_peer_without_a_token_gets_nothing_in(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ef" * 32)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\noperators = ["acme"]\n')
    d = daemon_factory(dram_capacity="8MiB", tcp=True, extra=["--config", str(config)])
    assert d.proc is not None and d.tcp_endpoint is not None
    token = issue_token(read_secret(secret), "acme", 60)
    with Client(d.tcp_endpoint, token=token) as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        ns.put(keys, [b"\5" * ns.block_bytes] * 2)
        before, peak_before = rss_mib(d.proc.pid), rss_mib(d.proc.pid, "VmHWM")
        peers, big_mib = 8, 64          # 512 MiB of large frames, none with a good token
        forged = issue_token(b"y" * 32, "acme", 60)
        flood = subprocess.run([sys.executable, "-c", BIG_TCP, d.tcp_endpoint, str(peers),
                                str(big_mib), forged], capture_output=True, text=True,
                               timeout=300)
        assert flood.stdout.strip() == "sent", flood.stderr
        after, peak = rss_mib(d.proc.pid), rss_mib(d.proc.pid, "VmHWM")
        # refused in the handshake: not one frame was read, not even for a moment (an
        # open tcp endpoint reads each whole before dropping it: its peak grows by them)
        assert after - before < 32, (before, after)
        assert peak - peak_before < 32, (peak_before, peak)
        client.ping()
        assert ns.get(keys) == [b"\5" * ns.block_bytes] * 2
        stats = client.stats()
        assert stats["before_hello"]["dropped"] == 0   # no junk ever reached the daemon
        assert stats["invariant_violations"] == 0
    assert d.alive()
