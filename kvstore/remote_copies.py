"""The remote store's copies, through the tier interface.

The store knows of the remote store only what the daemon told it: which blocks it holds
(``Block.remote``, set when a write there succeeded or a value was read from there) and
which DRAM copies are being written there before they leave DRAM (its write-back mode).
Lookups ask the remote store itself for the rest of a chain.  When the remote store lost
what it held (``remote_watch``), ``ForgetMarks`` takes the marks back, a slice at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvstore.blocks import REMOTE_MARK, Block
from kvstore.core import StoreCore

REMOTE = "remote"


class RemoteCopies:
    """The remote tier as a ``Tier``: the marks the store keeps of it."""

    name = REMOTE

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    def holds(self, block: Block) -> bool:
        return block.remote

    def drop(self, block: Block) -> None:
        block.remote = False  # forgotten here; the remote store keeps its own
        self.store.changed(block)

    def stats(self) -> dict[str, int]:
        return {"writing_back": len(self.store.remote_demoting),
                "write_backs": self.store.counters.remote_writebacks}

    def check(self, blocks: Iterable[Block]) -> None:
        """A block being written back here is demoting, cached, and has its DRAM copy."""
        for b in self.store.remote_demoting:
            assert b.demoting and b.offset is not None, f"{b} written back, not demoting"
            assert b.ns.blocks.get(b.key) is b, f"{b} written back but not cached"

    def __repr__(self) -> str:
        return f"RemoteCopies(writing_back={len(self.store.remote_demoting)})"


FORGET_TAKE = 512  # entries between two reads of the clock


class ForgetMarks:
    """Every ``Block.remote`` mark taken back, in slices: the remote store lost what it
    held, and a block kept marked would leave DRAM (and SSD) unwritten, lost.

    The namespaces' key maps, a shard at a time (a copy of one shard's entries, as
    ``index.NamespaceDrop`` takes them), each ``step`` a bounded number of entries or
    of time, so that a store of millions of blocks never holds the daemon's loop.
    Entries made since it began are of blocks committed or read since: what they are
    marked with came from the store as it is now.  Each block unmarked is announced (the
    event stream's remote copy withdrawn) and, where it has a DRAM copy, handed back by
    ``step`` to be written again (write-through; write-back writes it as it leaves).
    """

    def __init__(self, store: StoreCore) -> None:
        self.store = store
        self.count = 0  # marks taken back so far
        self._shards = [shard for ns in list(store.namespaces.values())
                        for shard in ns.blocks.shards]
        self._batch: list[Block] = []

    def step(self, budget: int, seconds: float) -> tuple[bool, list[Block]]:
        """Up to ``budget`` entries, or ``seconds``; whether it is over, and the blocks
        unmarked that have a DRAM copy."""
        deadline = time.perf_counter() + seconds
        in_dram: list[Block] = []
        changed = self.store.changed
        while budget > 0:
            if not self._batch:
                if not self._shards:
                    return True, in_dram
                self._batch = list(self._shards.pop().values())
            most = min(budget, FORGET_TAKE)  # (the clock read between takes)
            take = self._batch[-most:]
            del self._batch[-most:]
            budget -= len(take)
            for b in take:
                if b.marks & REMOTE_MARK and b.ns.blocks.get(b.key) is b:
                    b.marks &= ~REMOTE_MARK
                    changed(b)
                    self.count += 1
                    if b.offset is not None:
                        in_dram.append(b)
            if time.perf_counter() >= deadline:
                break
        return not self._batch and not self._shards, in_dram
