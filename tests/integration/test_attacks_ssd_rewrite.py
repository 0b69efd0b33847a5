"""A put of other bytes under a key whose block is only on SSD (KV caches are not
bit-exact from run to run, so a second engine's prefill of the same tokens differs) made
the new DRAM copy keep the SSD copy's checksum: the writer's own get then failed as
corrupt, and the block stayed unreadable to every reader that verifies.  The new copy's
checksum is now the block's, the stale SSD copy goes, and the new bytes reach SSD."""

from __future__ import annotations

import time
from typing import Any

from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks


def _only_on_ssd(c: Client, ns: Any, key: bytes) -> None:
    for chain in range(1, 12):            # DRAM (2 MiB: 32 blocks) fills: the block leaves it
        others = ns.keys(range(chain << 20, (chain << 20) + 16 * 8))
        ns.put(others, [bytes([chain]) * IDENT.block_bytes] * 8)
    deadline = time.monotonic() + 10
    while ns.lookup([key]).tiers != ["ssd"]:
        assert time.monotonic() < deadline, f"never only on SSD: {ns.lookup([key])}"
        time.sleep(0.05)


def test_other_bytes_under_an_ssd_only_key_read_back_verified(daemon_factory: Any) -> None:
    d = daemon_factory(ssd_capacity="64MiB", dram_capacity="2MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back"])
    first, second = b"\x11" * IDENT.block_bytes, b"\x22" * IDENT.block_bytes
    with Client(d.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENT)
        key = ns.keys(range(16))[0]
        ns.put([key], [first])
        _only_on_ssd(c, ns, key)
        ns.put([key], [second])           # another run's bytes for the same tokens
        assert ns.get([key]) == [second]  # verified against the new commit's checksum
        _only_on_ssd(c, ns, key)          # written to SSD again, with the new bytes
        assert ns.get([key]) == [second]
        stats = c.stats()
        assert stats["invariant_violations"] == 0
        assert stats["tiers"]["ssd"]["checksum_failures"] == 0
    d.stop()
    d.start()
    with Client(d.endpoint, tenant="acme", checksums=True) as c:
        assert c.namespace(IDENT).get([key]) == [second]


def test_other_bytes_without_checksums_leave_no_stale_one(daemon_factory: Any) -> None:
    """Committed again by a writer that gives no checksums, the block keeps none: the SSD
    copy's would fail every verifying reader of the new bytes."""
    d = daemon_factory(ssd_capacity="64MiB", dram_capacity="2MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back"])
    first, second = b"\x11" * IDENT.block_bytes, b"\x22" * IDENT.block_bytes
    with Client(d.endpoint, tenant="acme", checksums=True) as c, \
            Client(d.endpoint, tenant="acme", checksums=False) as plain:
        ns = c.namespace(IDENT)
        key = ns.keys(range(16))[0]
        ns.put([key], [first])
        _only_on_ssd(c, ns, key)
        plain.namespace(IDENT).put([key], [second])
        assert ns.get([key]) == [second]
        _only_on_ssd(c, ns, key)
        assert ns.get([key]) == [second]
        assert c.stats()["invariant_violations"] == 0
