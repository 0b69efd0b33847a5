"""A hostile tenant against a running daemon (session 63, second part): things cheap to
ask for that made the daemon hold memory or the loop without bound.  Real daemon
processes, raw ZeroMQ where a client library would not send what is sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq
from kvtest import make_identity
from test_attacks_s63 import Peer, fill

from kvstore import Client
from kvstore import protocol as p
from kvstore.routing import WHOLE_AT_ONCE, WHOLE_OPEN


def anon_mib(pid: int) -> float:
    """The daemon's anonymous memory (its heap: the arena is shared memory, apart)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


class Deaf:
    """A session of ``tenant`` on a DEALER that reads only when asked to (a queue of one
    and a small socket buffer): its unread replies stay in the daemon."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, tenant: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        self.send(p.Hello(1, p.PROTOCOL_VERSION, tenant))
        assert isinstance(self.read(), p.HelloReply)
        for rid in range(2, 6):  # small replies it leaves unread: its side's queue is full
            self.send(p.Ping(rid))

    def send(self, request: p.Message) -> None:
        self.sock.send(p.encoder.encode(request))

    def read(self, timeout: float = 30.0) -> p.Message:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close()


def refusal(reply: p.Message) -> str:
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.code == "limit_exceeded", reply
    return reply.message


def test_whole_snapshots_are_bounded_per_tenant_and_daemon_until_sent(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A whole snapshot (``limit`` 0) holds its reply, about 45 bytes a block, from its
    request until ZeroMQ has sent it.  They were bounded at two a session only, and a
    tenant may hold 4096 sessions: 40 sessions of one tenant asking two each of a
    30k-block store, never reading, grew the daemon by 194 MiB (now 5), and 100 sessions
    of a 60k-block store by 507 MiB.  Now a tenant has at most ``WHOLE_OPEN`` under way and the
    daemon ``WHOLE_AT_ONCE``, each counted until its reply is sent, past which a typed
    refusal says to ask in pages; pages are still served, and the count goes back once
    the replies are read."""
    d = daemon_factory(dram_capacity="512MiB", debug_invariants=False)
    blocks = 30_000
    fill(d.endpoint, "acme", blocks)
    ctx: zmq.Context[Any] = zmq.Context()
    deaf = [Deaf(ctx, d.endpoint, "acme") for _ in range(40)]
    try:
        time.sleep(0.3)
        before = anon_mib(d.proc.pid)
        for rid, peer in enumerate(deaf):
            peer.send(p.Snapshot(2 * rid + 10))
            peer.send(p.Snapshot(2 * rid + 11))
        time.sleep(1.0)  # (each takes ~30 ms alone; more go by turns)
        with Client(d.endpoint, tenant="acme") as c:  # a typed refusal, never a stall
            deadline = time.monotonic() + 30
            while True:  # (until the two admitted are built and in ZeroMQ's hands)
                extra = c._call(p.Snapshot(c._next_rid()))[0]
                if isinstance(extra, p.ErrorReply) or time.monotonic() > deadline:
                    break
            assert "ask in pages" in refusal(extra), extra
            assert len(c.snapshot(page=4096).blocks) == blocks  # pages: still served
        grown = anon_mib(d.proc.pid) - before
        assert grown < 30, (f"80 whole snapshots of {blocks} blocks asked by 40 sessions "
                            f"of one tenant, unread: the daemon grew by {grown:.0f} MiB")
        # the daemon's bound: other tenants' up to WHOLE_AT_ONCE in all (acme's two are
        # still unread), each held (360 KB: more than the socket buffers take) until its peer reads
        whole = WHOLE_AT_ONCE - WHOLE_OPEN
        for i in range(whole):
            fill(d.endpoint, f"t{i}", 8000)
        others = [Deaf(ctx, d.endpoint, f"t{i}") for i in range(whole)]
        for rid, peer in enumerate(others):
            peer.send(p.Snapshot(rid + 1000))
        time.sleep(1.0)
        with Client(d.endpoint, tenant="globex") as c:
            extra = c._call(p.Snapshot(c._next_rid()))[0]
            assert "in the daemon" in refusal(extra), extra
        # read (and gone): the counts go back, and a whole snapshot is served again
        answered = refused = 0
        for peer in deaf + others:
            while peer.sock.poll(200):
                reply = p.reply_decoder.decode(peer.sock.recv_multipart()[0])
                if isinstance(reply, p.OkReply):  # (the pings)
                    continue
                if isinstance(reply, p.SnapshotReply):
                    assert len(reply.blocks) == (blocks if peer in deaf else 8000)
                    answered += 1
                else:
                    refusal(reply)
                    refused += 1
        assert answered == WHOLE_OPEN + whole, answered
        assert answered + refused == 80 + whole, (answered, refused)
        for peer in deaf + others:
            peer.close()
        with Client(d.endpoint, tenant="acme") as c:
            for _ in range(WHOLE_OPEN):
                reply = c._call(p.Snapshot(c._next_rid()))[0]
                assert isinstance(reply, p.SnapshotReply), reply
                assert len(reply.blocks) == blocks
    finally:
        ctx.destroy(linger=0)


def test_paged_snapshots_never_finished_hold_no_copy_of_every_namespace(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Each paged snapshot under way (4 a session, a tenant's 4096 sessions) kept a list
    of every namespace of the daemon, and opening namespaces is cheap (20k in 3-5 s):
    2000 such snapshots begun with a page of one entry and never finished, at 20k
    namespaces, grew the daemon by 307 MiB and took 2.1 s to begin.  A walk now keeps
    the serial of the last namespace it reached (``kvstore.namespace_order``): +2 MiB,
    0.3 s; and a paged snapshot still lists every block, none of another tenant's."""
    d = daemon_factory(dram_capacity="16MiB", debug_invariants=False)
    fill(d.endpoint, "globex", 300)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        openers = [Peer(ctx, d.endpoint, "acme") for _ in range(20)]
        for j, peer in enumerate(openers):
            for i in range(1000):
                peer.send(p.OpenNamespace(i + 2, make_identity(model=f"m{j}-{i}")))
            opened = peer.replies(1000, 60)
            assert all(isinstance(r, p.NamespaceReply) for r in opened), opened[-1]
        walkers = [Peer(ctx, d.endpoint, "acme") for _ in range(500)]
        time.sleep(0.3)
        before = anon_mib(d.proc.pid)
        for peer in walkers:
            for rid in range(4):
                peer.send(p.Snapshot(10 + rid, 0, 1))
        for peer in walkers:
            pages = peer.replies(4, 60)
            assert len(pages) == 4 and all(isinstance(r, p.SnapshotReply) and r.cursor
                                           for r in pages), pages
        grown = anon_mib(d.proc.pid) - before
        assert grown < 40, (f"2000 paged snapshots under way at 20k namespaces: the "
                            f"daemon grew by {grown:.0f} MiB")
        # one of them read to its end: acme sees none of globex's blocks
        cursor, listed = pages[-1].cursor, len(pages[-1].blocks)
        while cursor:
            page = walkers[-1].ask(p.Snapshot(99, cursor, 4096))
            assert isinstance(page, p.SnapshotReply), page
            cursor, listed = page.cursor, listed + len(page.blocks)
        assert listed == 0
        with Client(d.endpoint, tenant="globex") as owner:
            assert len(owner.snapshot(page=1).blocks) == 300
    finally:
        ctx.destroy(linger=0)


def test_a_walk_skips_forgotten_namespaces_and_the_order_stays_bounded() -> None:
    """Namespaces forgotten while a walk is under way are skipped, those made after it
    began are not walked, and the order keeps at most about twice the store's."""
    from kvstore.routing import SnapshotWalk
    from kvstore.store import BlockStore, Reservation

    store = BlockStore(64 << 20, 1 << 20)
    kept = store.open_namespace(make_identity(model="kept"))
    r = store.reserve("w", kept, [b"k" * 16], None, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)
    early = [store.open_namespace(make_identity(model=f"early{i}")) for i in range(100)]
    walk = SnapshotWalk(store.order, 1)
    for ns in early:  # forgotten while the walk is under way
        assert store.close_namespace(ns)
    for i in range(5000):  # opened and closed: made and forgotten, one after another
        store.close_namespace(store.open_namespace(make_identity(model=f"gone{i}")))
    assert len(store.namespaces) == 1
    assert len(store.order.spaces) <= 2 * len(store.namespaces) + 64, store.order
    listed: list[Any] = []
    assert walk.page(1 << 20, listed)
    assert listed == [(b"k" * 16, None, "dram")]
