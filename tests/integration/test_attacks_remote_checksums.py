"""Bytes changed in DRAM after their commit (a writer scribbling through its mapping of
its arena) must not reach the remote store under a checksum of their own: a client that
committed with checksums gave the block's digest, and every daemon sharing the store
hands readers the value's.  Sent as they were, the changed bytes came back through
another daemon with a digest of them, and readers verified them as good."""

from __future__ import annotations

import time
from typing import Any

from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore.errors import CorruptError, NotFoundError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB


def test_bytes_changed_after_commit_are_not_sent_to_the_remote_store(
        redis_server: RedisServer, daemon_factory: Any) -> None:
    extra = ["--remote", redis_server.url, "--remote-write-policy", "write-back"]
    sixteen = str(16 * IDENT.block_bytes)  # DRAM holds 16 blocks
    a = daemon_factory(dram_capacity=sixteen, extra=["--slab-size", sixteen, *extra])
    b = daemon_factory(extra=extra)
    good = b"\x22" * IDENT.block_bytes
    base = 7 << 20
    with Client(a.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        key = ns.keys(range(base, base + 16))[0]
        with ns.reserve([key]) as r:
            r.buffers[0][:] = good
            r.commit()
            kept = c._slots(r.offsets, ns.block_bytes, readonly=False)[0]
        kept[:8] = b"\xee" * 8            # after the commit, through the mapping
        kept.release()
        for chain in range(1, 11):        # DRAM fills: cold blocks are written back
            start = base + (chain << 16)
            others = ns.keys(range(start, start + 16 * 4))
            ns.put(others, [bytes([chain]) * IDENT.block_bytes] * 4)
        deadline = time.monotonic() + 15
        while c.stats()["remote"]["write_backs"] < 8:
            assert time.monotonic() < deadline, "no write-back"
            time.sleep(0.05)
        stats = c.stats()
        assert stats["invariant_violations"] == 0
        assert stats["remote"]["changed_since_commit"] >= 1  # found, counted, not sent
    with Client(b.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        try:
            got = ns.get([key])
        except (CorruptError, NotFoundError):
            return                         # a miss, or caught: never served as good
        assert got == [good]


def test_blocks_changed_after_commit_do_not_stick_in_dram_under_write_back(
        redis_server: RedisServer, daemon_factory: Any) -> None:
    """Not sent, such a block must still leave DRAM: kept on the eviction order, it was
    the victim again at each eviction, hashed and refused again, and every later put
    failed ("blocks kept moving between tiers") once they filled the tier."""
    extra = ["--remote", redis_server.url, "--remote-write-policy", "write-back"]
    sixteen = str(16 * IDENT.block_bytes)
    a = daemon_factory(dram_capacity=sixteen, extra=["--slab-size", sixteen, *extra])
    base = 9 << 20
    with Client(a.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        for j in range(14):  # most of the tier, each changed after its commit
            key = ns.keys(range(base + (j << 8), base + (j << 8) + 16))[0]
            with ns.reserve([key]) as r:
                r.buffers[0][:] = b"\x22" * IDENT.block_bytes
                r.commit()
                kept = c._slots(r.offsets, ns.block_bytes, readonly=False)[0]
            kept[:8] = b"\xee" * 8
            kept.release()
        for chain in range(1, 11):  # each put must find room
            start = base + (chain << 16)
            others = ns.keys(range(start, start + 16 * 4))
            ns.put(others, [bytes([chain]) * IDENT.block_bytes] * 4)
        stats = c.stats()
        assert stats["invariant_violations"] == 0
        assert stats["remote"]["changed_since_commit"] == 14  # each found once, dropped
        assert a.alive(), a.log()
