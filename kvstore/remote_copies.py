"""The remote store's copies, through the tier interface.

The store knows of the remote store only what the daemon told it: which blocks it holds
(``Block.remote``, set when a write there succeeded or a value was read from there) and
which DRAM copies are being written there before they leave DRAM (its write-back mode).
Lookups ask the remote store itself for the rest of a chain.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.blocks import Block
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
