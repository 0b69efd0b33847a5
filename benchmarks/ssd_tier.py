"""SSD tier bandwidth: SSDStore against raw sequential pwrite/pread, side by side.

For 256 KiB and 2 MiB blocks, in batches, it writes and reads the same bytes through
``SSDStore`` (checksums, index commits, sync per batch) and through plain sequential
``os.pwrite``/``os.preadv`` with one ``fdatasync`` per batch, on the same filesystem, and
prints medians of several repeats, the store/raw ratios and the share of write time spent
in LMDB index commits.  Reads start from a dropped page cache where the process may drop
it (root); otherwise the output says "warm cache".

    python benchmarks/ssd_tier.py [--dir DIR] [--repeats 5] [--mib 256] [--batch 32]
                                  [--inflight 1,2] [--sync batch] [--no-direct-io]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

from kvstore.tiers.ssd import BlockRecord, SSDStore, SyncPolicy

KiB = 1 << 10
MiB = 1 << 20


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def timed(fn: Callable[[], None]) -> float:
    """Seconds one call of ``fn`` takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Case:
    """One block size: a raw file and a store over the same bytes."""

    def __init__(
        self, root: Path, block: int, total: int, batch: int, direct_io: bool, sync: str,
        inflight: int,
    ) -> None:
        self.block, self.total, self.batch, self.inflight = block, total, batch, inflight
        self.batches = total // (block * batch)
        # page-aligned source and sink, like slots of the daemon's DRAM arena
        self.arena = mmap.mmap(-1, block * batch * inflight)
        self.arena.write(os.urandom(block * batch * inflight))
        self.view = memoryview(self.arena)
        self.slots = [
            [self.view[(j * batch + i) * block:(j * batch + i + 1) * block] for i in range(batch)]
            for j in range(inflight)
        ]
        self.blocks = self.slots[0]
        self.raw_path = root / f"raw-{block}.dat"
        self.raw_fd = os.open(self.raw_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self.raw_fd, 0, total)
        self.store = SSDStore(
            root / f"store-{block}",
            total,
            slab_bytes=block * batch,
            sync=cast(SyncPolicy, sync),
            direct_io=direct_io,
        )
        namespace = os.urandom(16)
        self.records = [
            [
                BlockRecord(namespace, os.urandom(16), None, (b * batch + i) * block, block)
                for i in range(batch)
            ]
            for b in range(self.batches)
        ]
        self.committed: list[list[BlockRecord]] = [[] for _ in self.records]

    def raw_write(self) -> None:
        for b in range(self.batches):
            for i, data in enumerate(self.blocks):
                os.pwrite(self.raw_fd, data, (b * self.batch + i) * self.block)
            os.fdatasync(self.raw_fd)

    def raw_read(self) -> None:
        for b in range(self.batches):
            for i, data in enumerate(self.blocks):
                os.preadv(self.raw_fd, [data], (b * self.batch + i) * self.block)

    async def _batches(self, one: Callable[[int, list[memoryview]], Awaitable[None]]) -> None:
        """Run ``one`` for every batch, ``inflight`` at a time, each with its own buffers."""
        free = asyncio.Queue[list[memoryview]]()
        for slot in self.slots:
            free.put_nowait(slot)

        async def run(b: int) -> None:
            buffers = await free.get()
            try:
                await one(b, buffers)
            finally:
                free.put_nowait(buffers)

        await asyncio.gather(*(run(b) for b in range(self.batches)))

    def store_write(self) -> None:
        async def one(b: int, buffers: list[memoryview]) -> None:
            self.committed[b] = await self.store.write_blocks(self.records[b], buffers)

        asyncio.run(self._batches(one))

    def store_read(self) -> None:
        async def one(b: int, buffers: list[memoryview]) -> None:
            if not all(await self.store.read_many(self.committed[b], buffers)):
                raise RuntimeError("SSDStore read back a bad block")

        asyncio.run(self._batches(one))

    def close(self) -> None:
        self.store.close()
        os.close(self.raw_fd)
        self.blocks.clear()
        self.slots.clear()
        self.view.release()
        self.arena.close()


def measure(case: Case, repeats: int) -> tuple[dict[str, list[float]], list[float], bool]:
    """Seconds per repeat for each of the four runs, index shares, and whether cold."""
    seconds: dict[str, list[float]] = {k: [] for k in ("raw_w", "ssd_w", "raw_r", "ssd_r")}
    shares: list[float] = []
    cold = True
    for repeat in range(repeats):
        # alternate who goes first, so neither always meets the other's writeback
        order = ("raw", "ssd") if repeat % 2 == 0 else ("ssd", "raw")
        for who in order:
            cold &= drop_page_cache()
            if who == "raw":
                seconds["raw_w"].append(timed(case.raw_write))
            else:
                before = case.store.stats()["index_seconds"]
                took = timed(case.store_write)
                seconds["ssd_w"].append(took)
                shares.append((case.store.stats()["index_seconds"] - before) / took)
        for who in order:
            cold &= drop_page_cache()
            key = "raw_r" if who == "raw" else "ssd_r"
            seconds[key].append(timed(case.raw_read if who == "raw" else case.store_read))
    return seconds, shares, cold


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to put the files (default: system temp)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256, help="MiB written per run and size")
    parser.add_argument("--batch", type=int, default=32, help="blocks per batch")
    parser.add_argument(
        "--inflight", default="1,2", help="store batches in flight at once (comma list)"
    )
    parser.add_argument("--sync", default="batch", choices=("always", "batch", "none"))
    parser.add_argument("--no-direct-io", dest="direct_io", action="store_false")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvstore-ssd-bench-", dir=args.dir))
    print(
        f"SSD tier vs raw pwrite/pread: {args.mib} MiB per run, batches of {args.batch}, "
        f"sync={args.sync}, direct_io={args.direct_io}, "
        f"{args.repeats} repeats, dir {root}"
    )
    try:
        header = (
            f"{'block':>8} {'op':>5} {'in flight':>9} {'raw GB/s':>9} {'SSDStore GB/s':>14} "
            f"{'ratio':>6}  notes"
        )
        print(header)
        print("-" * len(header))
        for block, inflight in itertools.product(
            (256 * KiB, 2 * MiB), [int(n) for n in args.inflight.split(",")]
        ):
            total = args.mib * MiB // (block * args.batch) * block * args.batch
            case = Case(root, block, total, args.batch, args.direct_io, args.sync, inflight)
            try:
                seconds, shares, cold = measure(case, args.repeats)
                direct = case.store.direct_io
            finally:
                case.close()
            label = f"{block // KiB} KiB" if block < MiB else f"{block // MiB} MiB"
            for op, raw_key, ssd_key in (("write", "raw_w", "ssd_w"), ("read", "raw_r", "ssd_r")):
                raw = total / statistics.median(seconds[raw_key]) / 1e9
                ssd = total / statistics.median(seconds[ssd_key]) / 1e9
                if op == "write":
                    note = f"index commits {statistics.median(shares):.1%} of store write time"
                    if inflight > 1:
                        note += " (summed; they overlap other batches' I/O)"
                else:
                    note = "cold cache" if cold else "warm cache"
                if args.direct_io and not direct:
                    note += "; the filesystem refused O_DIRECT, store used buffered I/O"
                print(
                    f"{label:>8} {op:>5} {inflight:>9} {raw:9.2f} {ssd:14.2f} {ssd / raw:6.0%}  "
                    f"{note}"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
