"""A subscriber that never reads must not starve the others (issue #19).

The publisher refuses rather than drops unseen (``XPUB_NODROP``), so a full subscriber
is found and counted; the batch it refused then goes to every subscriber with room.
Real ``EventPublisher`` and real ZeroMQ sockets (their I/O threads carry the batches);
the stuck subscriber has a one-message queue and a 4 KiB socket buffer, so it fills
after a few dozen batches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvtest import make_identity

from kvstore import Client
from kvstore.config import EventsConfig
from kvstore.events import EventPublisher
from kvstore.store import BlockStore

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)
PAYLOAD = b"\x90" * 32768  # a batch's bytes (the subscribers only read its number)


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[EventPublisher]:
    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    pub = EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock",
                                      queue_batches=2), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    try:
        yield pub
    finally:
        pub.close()
        loop.close()


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
               stuck: bool = False) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.SUB)
    if stuck:  # queues next to nothing: full as soon as it stops reading
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def subscribed(pub: EventPublisher, *socks: zmq.Socket[bytes]) -> None:
    """Wait until every one of ``socks`` gets batches (a subscription reaches the
    publisher asynchronously); the batches sent meanwhile are read and forgotten."""
    deadline = time.monotonic() + 10
    waiting = set(socks)
    while waiting:
        assert time.monotonic() < deadline, "a subscription never arrived"
        pub.send(b"\x90", 0, True)
        time.sleep(0.01)
        for sock in list(waiting):
            while sock.poll(0):
                sock.recv_multipart()
                waiting.discard(sock)
    for sock in socks:
        while sock.poll(100):
            sock.recv_multipart()


def publish(pub: EventPublisher, healthy: zmq.Socket[bytes], count: int,
            also: zmq.Socket[bytes] | None = None) -> tuple[list[int], list[int]]:
    """Send ``count`` batches, each read by ``healthy`` (and ``also``, if given) before
    the next; the sequence numbers each got."""
    got: list[int] = []
    other: list[int] = []
    for _ in range(count):
        seq = pub.send(PAYLOAD, 1, True)
        for sock, seqs in ((healthy, got), (also, other)):
            if sock is not None and sock.poll(5000):
                seqs.append(int.from_bytes(sock.recv_multipart()[1], "big"))
            assert not seqs or seqs[-1] == seq, f"a reading subscriber missed {seq}"
    return got, other


def drain(sock: zmq.Socket[bytes]) -> list[int]:
    seqs = []
    while sock.poll(300):
        seqs.append(int.from_bytes(sock.recv_multipart()[1], "big"))
    return seqs


def test_a_stuck_subscriber_does_not_starve_a_healthy_one(publisher: EventPublisher) -> None:
    """A stuck subscriber costs the healthy one no batch: each one the stuck one's full
    queue refuses is counted and sent to the others; once it reads again, or leaves, the
    stream is exact again (nothing refused, every subscriber gets every batch)."""
    pub = publisher
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    endpoint = pub.endpoints[0]
    healthy = subscriber(ctx, endpoint)
    stuck = subscriber(ctx, endpoint, stuck=True)
    try:
        subscribed(pub, healthy, stuck)
        first = pub.seq
        got, _ = publish(pub, healthy, 400)
        # the healthy one got every batch, the stuck one's refusals included
        assert got == list(range(first, first + 400))
        stats = pub.stats()
        assert stats["lossy_batches"] >= 1, "the stuck subscriber never filled its queue"
        assert stats["dropped"] == 0
        # the stuck one stayed connected: it has the batches before its queue filled,
        # in order, and then missed the rest (ZeroMQ passed it over)
        seen = drain(stuck)
        assert seen and seen[0] == first and seen == sorted(set(seen))
        assert len(seen) < 400 and seen[-1] < first + 399
        # it reads again: exact again, nothing refused, both get every batch
        time.sleep(0.2)  # (its reads reach the publisher's side)
        lossy = pub.lossy_batches
        start = pub.seq
        got, seen = publish(pub, healthy, 100, also=stuck)
        seen += drain(stuck)
        assert got == list(range(start, start + 100))
        assert seen == list(range(start, start + 100))
        assert pub.lossy_batches == lossy
        # a second stuck subscriber fills up (found again: the stream was exact), then
        # leaves: exact again
        stuck2 = subscriber(ctx, endpoint, stuck=True)
        subscribed(pub, healthy, stuck, stuck2)
        start = pub.seq
        got, seen = publish(pub, healthy, 400, also=stuck)
        assert got == list(range(start, start + 400))
        assert pub.lossy_batches > lossy, "the second stuck subscriber was not found"
        seen += drain(stuck)
        assert seen == list(range(start, start + 400))  # the reading one missed nothing
        stuck2.close(linger=0)
        time.sleep(0.2)  # (its leaving reaches the publisher)
        lossy = pub.lossy_batches
        start = pub.seq
        got, seen = publish(pub, healthy, 100, also=stuck)
        seen += drain(stuck)
        assert got == seen == list(range(start, start + 100))
        assert pub.lossy_batches == lossy and pub.dropped == 0
    finally:
        for sock in (healthy, stuck):
            sock.close(linger=0)
        ctx.term()


def test_a_stuck_subscriber_holds_about_queue_bytes(tmp_path: Path) -> None:
    """ZeroMQ bounds a subscriber's queue in batches; the publisher sets that bound from
    the batches' sizes, so a subscriber that never reads holds about ``queue_bytes`` of
    large batches, not ``queue_batches`` of them, while a reading one misses none.
    Small batches again lengthen the queue back to ``queue_batches``."""
    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    config = EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock", queue_batches=1000,
                          queue_bytes=8 * len(PAYLOAD))
    pub = EventPublisher(config, store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    healthy = subscriber(ctx, pub.endpoints[0])
    stuck = subscriber(ctx, pub.endpoints[0], stuck=True)
    try:
        subscribed(pub, healthy, stuck)  # (tiny batches so far: the whole queue)
        assert pub.stats()["queue_limit"] == 1000
        first = pub.seq
        got, _ = publish(pub, healthy, 300)
        assert got == list(range(first, first + 300))  # the reader missed nothing
        assert pub.stats()["queue_limit"] == 8
        # The stuck one's queue, its socket's buffers (a few kB each side) and its own
        # one-message queue: 8 batches and a few, where the whole queue took all 300
        seen = drain(stuck)
        assert seen[0] == first and seen == sorted(set(seen))
        assert 8 <= len(seen) <= 8 + 6, len(seen)
        # a batch larger than queue_bytes: a queue of one
        pub.send(b"\x90" * (9 * len(PAYLOAD)), 1, True)
        assert pub.stats()["queue_limit"] == 1
        # 1000 small batches later the large ones have left the window: the whole
        # queue again
        for _ in range(1001):
            pub.send(b"\x90", 1, True)
            while healthy.poll(0):
                healthy.recv_multipart()
        assert pub.stats()["queue_limit"] == 1000
    finally:
        for sock in (healthy, stuck):
            sock.close(linger=0)
        ctx.term()
        pub.close()
        loop.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_stuck_subscriber_does_not_grow_the_daemon(daemon_factory: Any,
                                                     tmp_path: Path) -> None:
    """A real daemon publishing batches of about 40 kB (a commit's token ids) to a
    subscriber that never reads: its memory grows by about ``events.queue_bytes``
    (2 MiB here, filled before the measured commits), not by every batch
    (``queue_batches``, 10000 of them: 1200 commits grew it by 47 MiB)."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    d = daemon_factory(env={"KVSTORE_EVENTS_ENDPOINT": endpoint,
                            "KVSTORE_EVENTS_INTERVAL_MS": "0",
                            "KVSTORE_EVENTS_QUEUE_BYTES": "2MiB"})
    ident = make_identity(block_tokens=256)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stuck = subscriber(ctx, endpoint, stuck=True)
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(ident)

            last: list[list[bytes]] = []

            def store(i: int) -> None:
                base = 100_000 + i * 32 * 256  # token ids of 5 bytes each in msgpack
                keys = ns.keys(range(base, base + 32 * 256))
                with ns.reserve(keys) as r:
                    r.commit()
                if last:  # the index stays small: only the stream's queue grows
                    ns.evict(last.pop())
                last.append(keys)

            deadline = time.monotonic() + 10
            while not c.stats()["events"]["batches"] or not ns.events:
                assert time.monotonic() < deadline, "the subscription never arrived"
                store(0)
                time.sleep(0.06)
            for i in range(50):  # the daemon's own memory settles
                store(i)
            before = rss_mib(d.proc.pid)
            for i in range(1200):
                store(i)
            grown = rss_mib(d.proc.pid) - before
            events = c.stats()["events"]
        assert grown < 16, f"the daemon grew {grown:.1f} MiB"
        assert events["queue_limit"] < 100, events
        assert events["lossy_batches"] >= 1, "the stuck subscriber never filled up"
    finally:
        stuck.close(linger=0)
        ctx.term()
