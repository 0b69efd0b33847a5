"""Helpers for the SSD tier tests (a uniquely named module: every test folder has a conftest)."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from kvstore.config import load_config
from kvstore.store import BlockStore
from kvstore.tiering import SsdMover
from kvstore.tiers.ssd import BlockRecord, SSDStore
from kvstore.transfers import TransferGate

KiB = 1 << 10
MiB = 1 << 20
T = TypeVar("T")

StoreFactory = Callable[..., SSDStore]


def restoring_mover(path: Any, capacity: int, slab: int) -> tuple[BlockStore, SsdMover]:
    """A store (4 MiB of DRAM, LRU) and the mover that restores the SSD index at ``path``
    into it, with no data file read (each block's bytes come back empty)."""
    config = load_config(overrides={
        "dram": {"capacity": 4 * MiB, "eviction_policy": "lru"},
        "ssd": {"path": str(path), "capacity": capacity, "slab_size": slab,
                "direct_io": False, "preallocate": False}})
    store = BlockStore(config.dram_capacity, MiB, ssd_capacity=config.ssd_capacity,
                       ssd_slab_bytes=config.ssd_slab_bytes, eviction_policy="lru")
    return store, SsdMover(config, store, lambda ns, offset: memoryview(b""), TransferGate(4))


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one store coroutine to completion."""
    return asyncio.run(coro)


def block_bytes(key: bytes, length: int) -> bytes:
    """Bytes that follow from the key, so a reader can tell whose bytes it got."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(length)


def aligned_buffer(length: int) -> mmap.mmap:
    """A page-aligned buffer, like a slot of the daemon's DRAM arena."""
    return mmap.mmap(-1, length)


def chain(
    namespace: bytes, count: int, length: int, first_offset: int, *, stride: int | None = None
) -> list[BlockRecord]:
    """Records of a key chain of ``count`` blocks at consecutive slots."""
    records: list[BlockRecord] = []
    parent: bytes | None = None
    for i in range(count):
        key = os.urandom(16)
        offset = first_offset + i * (stride or length)
        records.append(BlockRecord(namespace, key, parent, offset, length))
        parent = key
    return records


def write(store: SSDStore, records: list[BlockRecord]) -> list[BlockRecord]:
    """Write records with bytes derived from their keys; returns the committed records."""
    return run(store.write_blocks(records, [block_bytes(r.key, r.length) for r in records]))


def read_ok(store: SSDStore, record: BlockRecord) -> bool:
    """Read a block back and check both the store's verdict and the bytes themselves."""
    buffer = bytearray(record.length)
    ok = run(store.read_into(record, buffer))
    if ok:
        assert bytes(buffer) == block_bytes(record.key, record.length)
    return ok
