"""How long the event loop is held while the SSD tier's copies are dropped, its directory
removed under the daemon (``SsdMover.lose``).

A store with ``--sizes`` SSD copies (chains of 1000 blocks, as a warm restart takes them
back from the SSD index: no data written), an SSD mover over a real directory; the loop
runs a probe that yields and times each turn (the collector settled as the daemon's
is), the directory is removed and ``lose`` called as the daemon's check would.  Printed
per size: the longest loop turn (the longest any client's request would wait), the
most CPU time one turn took (on a loaded machine the wall clock is mostly other
processes' turns on the CPU), the turns the drop took, and its whole time.

    python benchmarks/ssd_lost_stall.py --sizes 100k,200k,400k
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvstore.config import load_config
from kvstore.heap import settle_every
from kvstore.identity import Identity
from kvstore.store import BlockStore
from kvstore.tiering import SsdMover
from kvstore.transfers import TransferGate

LENGTH = 1000
SLOT = 8192


def parse_count(text: str) -> int:
    text = text.lower()
    return int(float(text[:-1]) * 1000) if text.endswith("k") else int(text)


def figures(n: int, work: Path) -> dict[str, float]:
    capacity = -(-n // LENGTH) * LENGTH * SLOT
    config = load_config(overrides={
        "dram": {"capacity": 4 << 20, "eviction_policy": "lru"},
        "ssd": {"path": str(work / "ssd"), "capacity": capacity, "slab_size": LENGTH * SLOT,
                "direct_io": False, "preallocate": False}})
    store = BlockStore(config.dram_capacity, 1 << 20, ssd_capacity=config.ssd_capacity,
                       ssd_slab_bytes=config.ssd_slab_bytes, eviction_policy="lru")
    mover = SsdMover(config, store, lambda ns, offset: memoryview(b""), TransferGate(4))
    ident = Identity(model="m", model_revision="r1", tenant="t", kv_dtype="float16",
                     num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)
    ns = store.open_namespace(ident)
    assert ns.block_bytes <= SLOT, ns.block_bytes
    for c in range(-(-n // LENGTH)):
        keys = [os.urandom(16) for _ in range(LENGTH)]
        store.ssd_copies.restore_columns(ns, keys, [0] + [1] * (LENGTH - 1),
                                         [(c * LENGTH + i) * SLOT for i in range(LENGTH)],
                                         [0] * LENGTH)
    copies = store.ssd_committed_slots

    async def run() -> dict[str, float]:
        unsettle = settle_every(asyncio.get_running_loop())  # (the daemon's collector)
        longest = longest_cpu = 0.0
        turns = 0
        stop = False

        async def probe() -> None:
            nonlocal longest, longest_cpu, turns
            while not stop:
                t, cpu = time.perf_counter(), time.thread_time()
                await asyncio.sleep(0)
                longest = max(longest, time.perf_counter() - t)
                longest_cpu = max(longest_cpu, time.thread_time() - cpu)
                turns += 1

        shutil.rmtree(work / "ssd")  # (before the probe: the daemon's check sees it later)
        task = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        longest = longest_cpu = 0.0
        turns = 0
        started = time.perf_counter()
        mover.lose("the directory was removed")
        while getattr(mover, "dropping", None) is not None:
            await asyncio.sleep(0)
        took = time.perf_counter() - started
        await asyncio.sleep(0.01)
        stop = True
        await task
        assert store.ssd_committed_slots == 0
        unsettle()
        return {"copies": copies, "longest_turn_ms": round(longest * 1e3, 2),
                "longest_turn_cpu_ms": round(longest_cpu * 1e3, 2),
                "turns": turns, "drop_ms": round(took * 1e3, 1)}

    try:
        return asyncio.run(run())
    finally:
        mover.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100k,200k,400k")
    args = parser.parse_args()
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as work:
            print(figures(parse_count(size), Path(work)), flush=True)


if __name__ == "__main__":
    main()
