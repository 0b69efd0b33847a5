"""A peer that sends requests and never reads the replies, against a real daemon: what
it costs the daemon stays bounded (ZeroMQ's send queue to it held every reply, so a few
hundred KiB of requests held hundreds of MiB until it disconnected), it is told why once
it reads, and it is served again when it does."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_attacks import configured, held
from test_protocol_abuse import error_code

from kvstore import Client
from kvstore import protocol as p


class Deaf:
    """A DEALER that reads only when asked to: a queue of one message on its side and a
    small socket buffer, so unread replies pile up in the daemon, not here.  It says
    hello as tenant acme first."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        assert isinstance(self.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme")), p.HelloReply)

    def send(self, msg: p.Message) -> None:
        self.sock.send(p.encoder.encode(msg))

    def read_all(self, quiet_ms: int = 1000) -> list[p.Message]:
        """Every reply that comes until none has for ``quiet_ms``."""
        out = []
        while self.sock.poll(quiet_ms):
            out.append(p.reply_decoder.decode(self.sock.recv_multipart()[0]))
        return out

    def ask(self, msg: p.Message) -> p.Message:
        """``msg``'s reply (its rid), past any older ones still coming."""
        self.send(msg)
        while True:
            assert self.sock.poll(10_000), "the daemon did not answer"
            reply = p.reply_decoder.decode(self.sock.recv_multipart()[0])
            if reply.rid == msg.rid:
                return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def replies_stats(daemon: DaemonProcess) -> dict[str, int]:
    with Client(daemon.endpoint, tenant="audit") as client:
        stats: dict[str, int] = client.stats()["replies"]
    return stats


def wait_for(test: Callable[[dict[str, int]], bool], daemon: DaemonProcess,
             seconds: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    while True:
        stats = replies_stats(daemon)
        if test(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def tiny_cache(daemon_factory: Any, tmp_path: Path, chains: int) -> DaemonProcess:
    """A daemon whose sessions may have 1 MiB under way, holding ``chains`` times 4096
    blocks of 4 bytes (a snapshot page of them is a few hundred KiB).

    In chains of 64 blocks: a page goes through the key map for roots and stops after
    2 ms, and with two roots among 8192 keys a loaded machine's page found none (60
    empty pages, none refused, in a run with the suite twice at once)."""
    daemon = configured(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "1MiB"\n')
    tiny = make_identity(num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(tiny)
        for _ in range(chains * 64):
            ns.put([os.urandom(16) for _ in range(64)], [b"abcd"] * 64)
    return daemon


def test_small_replies_never_read_are_dropped_past_the_queue_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    daemon = configured(daemon_factory, tmp_path, "[server]\nmax_unread_replies = 64\n")
    deaf = Deaf(daemon.endpoint)
    try:
        asks = 4000  # stats replies of about a KiB each: 4 MB, far past the bound
        for rid in range(2, 2 + asks):
            deaf.send(p.Stats(rid))
        # what the socket buffers and the 64 queued take is a few hundred at most
        stats = wait_for(lambda s: s["dropped_unread"] >= asks - 1000, daemon)
        assert stats["dropped_unread"] >= asks - 1000, stats
        got = deaf.read_all()
        # the queue's, then the buffers' (libzmq takes "as much as 90% lower" than the
        # high-water mark at times: 63 of 64 came once in a full run on a busy machine)
        assert 7 <= len(got) <= 1000, len(got)
        assert all(isinstance(reply, p.StatsReply) for reply in got)
        # reading again, it is served again
        assert isinstance(deaf.ask(p.Stats(10 ** 6)), p.StatsReply)
    finally:
        deaf.close()
    assert held(daemon) == (0, 0, 0)


def test_big_replies_never_read_stay_within_the_bytes_in_flight(
        daemon_factory: Any, tmp_path: Path) -> None:
    # snapshot pages of a few hundred KiB each: before, 600 unread whole snapshots of a
    # 40k-block cache (13-byte requests) held 400 MiB in the daemon
    daemon = tiny_cache(daemon_factory, tmp_path, 2)
    deaf = Deaf(daemon.endpoint)
    try:
        asks = 60
        for rid in range(2, 2 + asks):
            deaf.send(p.Snapshot(rid, 0, 8192))  # a page of the whole cache each
        # once every request is served or refused the count stays put; pages go on to
        # the connection's socket buffers as far as they take them, so it may be far
        # under the bound by then (768 KiB in one CI run, 72 KiB in another): the bound
        # is what it never passes, and the refusals below show it was reached
        stats = wait_for(lambda s: s["unread_bytes"] >= 256 << 10, daemon)
        last = -1
        while stats["unread_bytes"] != last:
            assert stats["unread_bytes"] < 8 << 20, stats
            last = stats["unread_bytes"]
            time.sleep(0.5)
            stats = replies_stats(daemon)
        got = deaf.read_all()
        assert len(got) == asks  # every request answered: none dropped, none lost
        pages = [reply for reply in got if isinstance(reply, p.SnapshotReply)]
        refused = [reply for reply in got if not isinstance(reply, p.SnapshotReply)]
        assert pages and refused, (len(pages), len(refused))
        assert all(error_code(reply) == "limit_exceeded" for reply in refused)
        assert isinstance(refused[0], p.ErrorReply)
        assert "replies are not read yet" in refused[0].message
        # read: its bytes go back, and the next page is served
        assert wait_for(lambda s: s["unread_bytes"] == 0, daemon)["unread_bytes"] == 0
        assert isinstance(deaf.ask(p.Snapshot(10 ** 6, 0, 8192)), p.SnapshotReply)
    finally:
        deaf.close()
    assert held(daemon) == (0, 0, 0)


def test_a_reader_gone_with_replies_unread_leaves_no_count(
        daemon_factory: Any, tmp_path: Path) -> None:
    # the replies still queued to a peer that disconnects are freed with its connection,
    # and their bytes no longer counted
    daemon = tiny_cache(daemon_factory, tmp_path, 1)
    deaf = Deaf(daemon.endpoint)
    for rid in range(2, 40):
        deaf.send(p.Snapshot(rid, 0, 4096))
    assert wait_for(lambda s: s["unread_bytes"] > 0, daemon)["unread_bytes"] > 0
    deaf.close()
    assert wait_for(lambda s: s["unread_bytes"] == 0, daemon)["unread_bytes"] == 0
    assert held(daemon) == (0, 0, 0)
