"""One tenant's flood of remote reads leaves the remote tier to the others.

A real daemon over a real redis-server.  A tenant sends best-effort prefetches of 4096
random keys each, without waiting for their replies, a few hundred a second: each one a
remote read (or lookup) of 4096 keys.  Before, every one of them queued at the tier's
bound on its calls ahead of any other tenant's read, and each was one backend call of
4096 keys under one timeout: on a busy daemon one timed out ("remote read failed
(get_into did not finish within 2 s)"), the tier was skipped for every tenant, and
another tenant's blocks, held only by the remote store, were not found.  Now the
tenants' reads and lookups take turns and go in pieces of ``CALL_KEYS_MOST`` keys.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import zmq
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore import protocol as p
from kvstore.remote import CALL_KEYS_MOST

VICTIM = make_identity(tenant="globex")
FLOOD_KEYS = 4096
FLOOD_REQUESTS = 1500
FLOOD_RATE = 300.0  # requests a second
CHAINS = 40
CHAIN = 4


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def flood(endpoint: str, done: threading.Event, replies: dict[str, int]) -> None:
    """Prefetches of random keys from a bare socket of tenant acme, never waiting."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme", "", "")))
        assert sock.poll(10_000)
        assert isinstance(p.reply_decoder.decode(sock.recv_multipart()[0]), p.HelloReply)
        sock.send(p.encoder.encode(p.OpenNamespace(2, make_identity(tenant="acme"))))
        assert sock.poll(10_000)
        opened = p.reply_decoder.decode(sock.recv_multipart()[0])
        assert isinstance(opened, p.NamespaceReply), opened
        requests = [p.encoder.encode(p.Prefetch(10 + i, opened.ns,
                                                [os.urandom(16) for _ in range(FLOOD_KEYS)]))
                    for i in range(50)]
        start = time.monotonic()
        for i in range(FLOOD_REQUESTS):
            sock.send(requests[i % len(requests)])
            while sock.poll(0):
                reply = p.reply_decoder.decode(sock.recv_multipart()[0])
                name = type(reply).__name__ + getattr(reply, "code", "")
                replies[name] = replies.get(name, 0) + 1
            time.sleep(max(0.0, start + (i + 1) / FLOOD_RATE - time.monotonic()))
    finally:
        done.set()
        sock.close()
        ctx.term()


def test_another_tenants_remote_reads_go_on_through_a_flood(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    assert CALL_KEYS_MOST < FLOOD_KEYS
    writer = daemon_factory(extra=["--remote", fresh_redis_server.url])
    chains: list[list[bytes]] = []
    with Client(writer.endpoint, tenant="globex") as c:
        ns = c.namespace(VICTIM)
        for i in range(CHAINS):
            keys = ns.keys(range(i * 1000, i * 1000 + CHAIN * VICTIM.block_tokens))
            ns.put(keys, [bytes([i]) * VICTIM.block_bytes for _ in keys])
            chains.append(keys)
        deadline = time.monotonic() + 15
        while c.stats()["remote"]["writes"] < CHAINS * CHAIN:
            assert time.monotonic() < deadline, c.stats()["remote"]
            time.sleep(0.05)
    d = daemon_factory(extra=["--remote", fresh_redis_server.url])  # its DRAM holds none
    assert d.proc is not None
    before = rss_kib(d.proc.pid)
    done = threading.Event()
    replies: dict[str, int] = {}
    flooding = threading.Thread(target=flood, args=(d.endpoint, done, replies))
    read: list[int] = []
    peak = before
    with Client(d.endpoint, tenant="globex") as c:
        ns = c.namespace(VICTIM)
        assert ns.get(chains[0]) == [bytes([0]) * VICTIM.block_bytes] * CHAIN  # as before
        flooding.start()
        try:
            time.sleep(0.5)
            for i, keys in enumerate(chains[1:], start=1):
                if done.is_set():
                    break
                # the blocks only the remote store holds: read in, whole and intact
                assert ns.get(keys) == [bytes([i]) * VICTIM.block_bytes] * CHAIN, i
                read.append(i)
                peak = max(peak, rss_kib(d.proc.pid))
                time.sleep(0.1)
        finally:
            flooding.join()
        remote = c.stats()["remote"]
    assert len(read) >= 10, (read, replies)  # one after another during the flood
    assert sum(replies.values()) > FLOOD_REQUESTS // 4, replies  # it was served too
    assert remote["healthy"] and remote["timeouts"] == 0 and remote["errors"] == 0, remote
    # the work a tenant has under way is bounded: not gigabytes of keys and tasks
    assert peak - before < 512 << 10, (before, peak)
