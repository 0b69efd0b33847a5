"""A clean stop under write-back on an SSD tier whose slabs all hold another block size.

The flush on the way out planned each size's blocks only DRAM held from that size's own
SSD slots and the empty slabs: once the tier's slabs all held one size (a long run of one
model), a second model's blocks, the hottest there were, were never written, and a
restart found none of them.  Now the flush hands a size with no room of its own slabs
of the size with most, as a demotion does while serving (their copies given up whole:
no entry left naming a slot another size's bytes overwrote), each size keeping at least
half the slabs it held when the stop began.
"""

from __future__ import annotations

import hashlib
import signal
import time
from typing import Any

from kvtest import make_identity

from kvstore import Client

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
SMALL = make_identity(model="small", num_layers=2, num_kv_heads=4, head_dim=64)  # 32 KiB


def content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def put(ns: Any, ident: Any, first: int, blocks: int = 16) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(first, first + blocks * ident.block_tokens))
    ns.put(keys, [content(k, ident.block_bytes) for k in keys])
    return keys


def test_a_clean_stop_saves_a_new_sizes_blocks_on_an_ssd_tier_full_of_another(
        daemon_factory: Any) -> None:
    # four SSD slabs of 16 big slots; DRAM for 32 big blocks
    d = daemon_factory(ssd_capacity="4MiB", dram_capacity="2MiB",
                       env={"KVSTORE_SSD_SLAB_SIZE": "1MiB"},
                       extra=["--slab-size", "1MiB", "--log-level", "info"])
    with Client(d.endpoint, tenant="acme") as client:
        big_ns = client.namespace(BIG)
        bigs = [put(big_ns, BIG, 100_000 * i) for i in range(6)]  # more than both tiers
        deadline = time.monotonic() + 20  # (demotions end in the background)
        while client.stats()["tiers"]["ssd"]["committed_slots"] < 64:
            assert time.monotonic() < deadline, "the ssd tier did not fill"
            time.sleep(0.05)
        assert client.stats()["tiers"]["ssd"]["empty_slabs"] == 0
        small_ns = client.namespace(SMALL)
        smalls = put(small_ns, SMALL, 0)  # only DRAM holds it: the newest, the hottest
        assert small_ns.lookup(smalls).tiers == ["dram"] * 16
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        slabs = {c["slot_bytes"]: c["slabs"] for c in stats["slab_classes"]["ssd"]}
        assert slabs.get(SMALL.block_bytes, 0) == 0  # the tier's slabs all the big size's
    assert d.stop(signal.SIGTERM) == 0
    d.start()
    log = d.log()
    assert "dropped at restore" not in log  # every parent of what was kept kept
    with Client(d.endpoint, tenant="acme") as client:
        small_ns, big_ns = client.namespace(SMALL), client.namespace(BIG)
        hit = small_ns.lookup(smalls)
        assert hit.blocks == 16 and set(hit.tiers) == {"ssd"}
        assert small_ns.get(smalls) == [content(k, SMALL.block_bytes) for k in smalls]
        kept = 0
        for keys in bigs:  # what the big size kept reads back whole, checksums verified
            n = big_ns.lookup(keys).blocks
            assert big_ns.get(keys[:n]) == [content(k, BIG.block_bytes) for k in keys[:n]]
            kept += n
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        ssd = stats["tiers"]["ssd"]
        assert ssd["checksum_failures"] == 0
        # a slab given to the small size (32 slots, 16 used), at least half of the big
        # size's kept (two slabs or more)
        slabs = {c["slot_bytes"]: c["slabs"] for c in stats["slab_classes"]["ssd"]}
        assert slabs[SMALL.block_bytes] == 1 and slabs[BIG.block_bytes] >= 2
        assert 32 <= kept <= 48
