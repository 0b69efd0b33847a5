"""A put larger than a loop turn's copy (``PUT_SLICE_BYTES``) is copied into the arena
a slice a turn: its bytes land exactly as sent, blocks larger than a slice included,
and the daemon answers other clients' requests meanwhile (real daemon process)."""

from __future__ import annotations

import os
import threading
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.verbs import PUT_SLICE_BYTES

# 2 layers x 2 x 1024 heads x 128 x fp16 x 16 tokens = 16 MiB a block: two slices each
BIG = make_identity(model="big-blocks", num_kv_heads=1024, head_dim=128)
SMALL = make_identity(model="small-blocks", num_layers=64, num_kv_heads=8, head_dim=128)


def test_a_put_over_a_slice_lands_exactly_and_others_are_served(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="256MiB")
    assert BIG.block_bytes > PUT_SLICE_BYTES
    with Client(d.endpoint, tenant="acme") as c, Client(d.endpoint, tenant="globex") as other:
        big = c.namespace(BIG)
        blocks = [os.urandom(big.block_bytes) for _ in range(3)]
        keys = big.keys(range(3 * BIG.block_tokens))
        small = c.namespace(SMALL)  # many blocks of a few MiB in all
        assert 4 * small.block_bytes * 8 > PUT_SLICE_BYTES
        small_blocks = [os.urandom(small.block_bytes) for _ in range(32)]
        small_keys = small.keys(range(32 * SMALL.block_tokens))
        pings: list[int] = []
        stop = threading.Event()

        def ping() -> None:  # another client's requests while the puts copy
            while not stop.is_set():
                other.ping()
                pings.append(1)

        t = threading.Thread(target=ping)
        t.start()
        try:
            created = big.put(keys, blocks)
            small.put(small_keys, small_blocks)
        finally:
            stop.set()
            t.join(30)
        assert created == 3
        assert big.get(keys) == blocks
        assert small.get(small_keys) == small_blocks
        assert pings, "the other client was never answered"
        dram = c.stats()["tiers"]["dram"]
        assert dram["reserved_slots"] == 0 and dram["blocks"] == 35
