"""A hostile tenant against the running daemon (session 62): what one tenant has under
way leaves the other tenants served.  Real daemon processes, raw ZeroMQ."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq
from kvtest import make_identity

from kvstore import protocol as p


class Peer:
    """A raw DEALER connection with a session of ``tenant``; ``unread``: one that takes
    in next to nothing of its replies (a kernel buffer of 4 KiB, one message queued)."""

    def __init__(self, endpoint: str, tenant: str, *, unread: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if unread:
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        assert isinstance(self.ask(p.Hello(1, p.PROTOCOL_VERSION, tenant)), p.HelloReply)

    def send(self, request: p.Message, *payload: bytes) -> None:
        self.sock.send_multipart([p.encoder.encode(request), *payload])

    def ask(self, request: p.Message, *payload: bytes) -> p.Message | None:
        self.send(request, *payload)
        if not self.sock.poll(10_000):
            return None
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


MOST = 8  # server.max_requests_under_way in the test below


def test_a_tenants_evicts_behind_its_unread_gets_leave_others_the_bound_on_work_under_way(
        daemon_factory: Any, tmp_path: Path) -> None:
    """An evict or a drop is never refused for the daemon's bound on requests under way
    (it frees the room that others wait for), but it counted in the bound, and an evict
    waits up to a second for its session's get replies still being sent.  A tenant that
    left its get replies unread and sent evicts held the whole bound with them, second
    after second: every other tenant's request that had to wait (here a whole snapshot)
    was refused ``limit_exceeded``.  Evicts and drops now count against no one else's
    requests."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f"[server]\nmax_requests_under_way = {MOST}\n")
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert d.tcp_endpoint is not None
    hog = Peer(d.tcp_endpoint, "acme", unread=True)
    other = Peer(d.tcp_endpoint, "globex")
    try:
        big = make_identity(tenant="acme", num_layers=32, num_kv_heads=8, head_dim=128)
        opened = hog.ask(p.OpenNamespace(2, big))
        assert isinstance(opened, p.NamespaceReply), opened
        keys = [bytes([i]) * 16 for i in range(1, 5)]
        put = hog.ask(p.Put(3, opened.ns, keys), *[b"\1" * opened.block_bytes] * len(keys))
        assert isinstance(put, p.PutReply) and put.created == len(keys), put
        for i in range(4):  # 8 MiB replies each, never read: still being sent
            hog.send(p.Get(10 + i, opened.ns, keys))
        time.sleep(0.3)
        for i in range(MOST + 4):  # each waits for those replies (a second at most)
            hog.send(p.Evict(100 + i, opened.ns, [b"\x77" * 16]))
        deadline = time.monotonic() + 0.5
        while True:  # the daemon has read them (they wait)
            stats = other.ask(p.Stats(2))
            assert isinstance(stats, p.StatsReply), stats
            if stats.stats["under_way"]["requests"] >= MOST:
                break
            assert time.monotonic() < deadline, stats.stats["under_way"]
        whole = other.ask(p.Snapshot(3))  # a reply made in a task: counted under way
        assert isinstance(whole, p.SnapshotReply), whole
        assert d.alive()
    finally:
        hog.close()
        other.close()
