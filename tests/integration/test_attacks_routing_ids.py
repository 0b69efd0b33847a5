"""A peer with no credentials that claims the routing ids the daemon's ROUTER would give
the next peers.  libzmq numbers peers that name no routing id from a counter that starts
at ``rand()``; a peer may name any routing id, those of that counter too, and the next
peer numbered onto one held aborts the whole process (an assertion in libzmq).  Left
unseeded, ``rand()`` starts every daemon's counter at the same few values."""

from __future__ import annotations

import ctypes
import time

import zmq

from daemon_proc import DaemonProcess
from test_protocol_abuse import hello, Raw

# first values a never-seeded glibc rand() hands out, as libzmq makes them a counter's
# start (two calls each: the second gives the top bit)
_CLAIMED_PER_START = 16


def _unseeded_starts() -> set[int]:
    libc = ctypes.CDLL(None)
    libc.srand(1)  # glibc's rand() before any srand() is srand(1)'s sequence
    values = [libc.rand() for _ in range(24)]
    return {(values[i] | values[i + 1] << 31) & 0xffffffff for i in range(23)}


def test_a_peer_claiming_the_next_routing_ids_does_not_kill_the_daemon(
        daemon: DaemonProcess) -> None:
    ctx = zmq.Context()
    claims: list[zmq.Socket[bytes]] = []
    try:
        for start in _unseeded_starts():
            for k in range(_CLAIMED_PER_START):
                sock = ctx.socket(zmq.DEALER)
                claims.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                claimed = (start + k) & 0xffffffff
                sock.setsockopt(zmq.ROUTING_ID, b"\0" + claimed.to_bytes(4, "big"))
                sock.connect(daemon.endpoint)
        time.sleep(0.3)  # (the connections' handshakes, in libzmq's threads)
        for _ in range(3):  # peers numbered by the daemon's counter
            raw = Raw(daemon.endpoint)
            try:
                assert daemon.alive(), daemon.log()
                hello(raw)
            finally:
                raw.close()
    finally:
        for sock in claims:
            sock.close(linger=0)
        ctx.term()
    assert daemon.alive(), daemon.log()
