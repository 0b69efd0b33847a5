"""Bytes changed in DRAM after their commit (a writer scribbling through its mapping of
its arena) must not reach the SSD tier under a checksum of their own: a client that
committed with checksums gave the block's digest, and readers verify against what the
daemon hands back.  Written back as they were, the changed bytes came back after a
restart with the SSD tier's fresh digest of them, and readers verified them as good."""

from __future__ import annotations

from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import CorruptError, NotFoundError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks


def test_bytes_changed_after_commit_never_come_back_verified(daemon_factory: Any) -> None:
    d = daemon_factory(ssd_capacity="64MiB", dram_capacity="2MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back"])
    good = b"\x11" * IDENT.block_bytes
    with Client(d.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        key = ns.keys(range(16))[0]
        with ns.reserve([key]) as r:
            r.buffers[0][:] = good
            r.commit()
            kept = c._slots(r.offsets, ns.block_bytes, readonly=False)[0]
        kept[:8] = b"\xee" * 8            # after the commit, through the mapping
        kept.release()
        for chain in range(1, 11):        # DRAM fills: the block is written back
            others = ns.keys(range(chain << 20, (chain << 20) + 16 * 8))
            ns.put(others, [bytes([chain]) * IDENT.block_bytes] * 8)
        stats = c.stats()
        assert stats["invariant_violations"] == 0
        assert stats["tiers"]["ssd"]["checksum_failures"] >= 1  # found, counted
    d.stop()
    d.start()
    with Client(d.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        try:
            got = ns.get([key])
        except (CorruptError, NotFoundError):
            return                         # a miss, or caught: never served as good
        assert got == [good]
