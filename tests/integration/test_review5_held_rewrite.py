"""A block only on SSD, committed again with other bytes while its SSD copy is held (a
reservation below it keeps it, or a read of it is under way), kept that stale copy: the
new DRAM copy took the new checksum, the stale copy stayed the block's SSD copy, so the
block left DRAM without being written, and the next read of it failed its checksum and
took what hung below it along.  Such a commit is now a duplicate, as over a DRAM copy:
the block keeps its SSD copy and its checksum, and every read of it verifies."""

from __future__ import annotations

import time
from typing import Any

from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks


def _only_on_ssd(ns: Any, keys: list[bytes]) -> None:
    for chain in range(1, 12):            # DRAM (2 MiB: 32 blocks) fills: the keys leave it
        others = ns.keys(range(chain << 20, (chain << 20) + 16 * 8))
        ns.put(others, [bytes([chain]) * IDENT.block_bytes] * 8)
    deadline = time.monotonic() + 10
    while ns.lookup(keys).tiers != ["ssd"] * len(keys):
        assert time.monotonic() < deadline, f"never only on SSD: {ns.lookup(keys)}"
        time.sleep(0.05)


def test_other_bytes_over_a_held_ssd_copy_leave_every_read_verified(
        daemon_factory: Any) -> None:
    d = daemon_factory(ssd_capacity="64MiB", dram_capacity="2MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back"])
    first, second = b"\x11" * IDENT.block_bytes, b"\x22" * IDENT.block_bytes
    child = b"\x33" * IDENT.block_bytes
    with Client(d.endpoint, tenant="acme", checksums=True) as c, \
            Client(d.endpoint, tenant="acme", checksums=True) as other:
        ns, ns2 = c.namespace(IDENT), other.namespace(IDENT)
        head, below = ns.keys(range(32))[:2]
        ns.put([head], [first])
        _only_on_ssd(ns, [head])
        r = ns2.reserve([below], parent=head)   # holds head's SSD copy until it commits
        ns.put([head], [second])                # another run's bytes for the same tokens
        r.buffers[0][:] = child
        r.commit()
        got_head = ns.get([head])[0]            # verified (the client checks each block)
        assert got_head in (first, second)
        _only_on_ssd(ns, [head, below])         # both leave DRAM (written to SSD if not there)
        assert ns.get([head, below]) == [got_head, child]
        stats = c.stats()
        assert stats["tiers"]["ssd"]["checksum_failures"] == 0
        assert stats["invariant_violations"] == 0
