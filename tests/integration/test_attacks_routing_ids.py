"""A peer with no credentials that claims the routing ids a ROUTER of the daemon would
give the next peers.  libzmq numbers peers that name no routing id from a counter that
starts at ``rand()``; a peer may name any routing id, those of that counter too, and the
next peer numbered onto one held aborts the whole process (an assertion in libzmq).
Left unseeded, ``rand()`` starts every daemon's counters at the same few values."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from daemon_proc import DaemonProcess

from kvstore import protocol as p
from kvstore.events import END_SEQ

_CLAIMED_PER_START = 16


def _unseeded_starts() -> set[int]:
    """Where libzmq starts a ROUTER's counter in a process that never seeded rand(): a
    value of glibc's sequence (two calls each: the second gives the top bit)."""
    libc = ctypes.CDLL(None)
    libc.srand(1)  # glibc's rand() before any srand() is srand(1)'s sequence
    values = [libc.rand() for _ in range(24)]
    return {(values[i] | values[i + 1] << 31) & 0xffffffff for i in range(23)}


def _claim_then_connect(daemon: DaemonProcess, endpoint: str,
                        talk: Callable[[zmq.Socket[bytes]], None]) -> None:
    """Hold the routing ids an unseeded counter would give next, then connect peers
    that name none and ``talk`` to the daemon: it must answer and stay up."""
    ctx = zmq.Context()
    held: list[zmq.Socket[bytes]] = []
    try:
        for start in _unseeded_starts():
            for k in range(_CLAIMED_PER_START):
                sock = ctx.socket(zmq.DEALER)
                held.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                claimed = (start + k) & 0xffffffff
                sock.setsockopt(zmq.ROUTING_ID, b"\0" + claimed.to_bytes(4, "big"))
                sock.connect(endpoint)
        time.sleep(0.3)  # (the connections' handshakes, in libzmq's threads)
        for _ in range(3):  # peers the daemon's counter numbers
            sock = ctx.socket(zmq.DEALER)
            held.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            talk(sock)
            assert daemon.alive(), daemon.log()
    finally:
        for sock in held:
            sock.close(linger=0)
        ctx.term()
    assert daemon.alive(), daemon.log()


def _say_hello(sock: zmq.Socket[bytes]) -> None:
    sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme")))
    assert sock.poll(10_000), "the daemon did not answer"
    assert isinstance(p.reply_decoder.decode(sock.recv()), p.HelloReply)


def test_a_peer_claiming_the_next_routing_ids_does_not_kill_the_daemon(
        daemon: DaemonProcess) -> None:
    _claim_then_connect(daemon, daemon.endpoint, _say_hello)


def test_a_peer_claiming_the_replay_sockets_next_routing_ids_does_not_kill_the_daemon(
        daemon_factory: Any, tmp_path: Path) -> None:
    replay = f"ipc://{tmp_path / 'replay.sock'}"
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[events]\nendpoint = "ipc://{tmp_path / "events.sock"}"\n'
                      f'replay_endpoint = "{replay}"\n')
    daemon = daemon_factory(extra=["--config", str(config)])
    _claim_then_connect(daemon, replay, _ask_replay)


def _ask_replay(sock: zmq.Socket[bytes]) -> None:
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    assert sock.poll(10_000), "the replay socket did not answer"
    while sock.recv_multipart()[1] != END_SEQ and sock.poll(10_000):
        pass
