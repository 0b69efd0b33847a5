"""The tier interface: what the store knows of one tier's copies of blocks.

DRAM (``dram_copies``), SSD (``ssd_copies``), the remote store (``remote_copies``) and
the GPU pool (``gpu_copies``) each implement it; the store lists them in ``tiers`` and
reads figures and invariants through it, never a tier by name.  A tier keeps the
bookkeeping of its copies (slots, orders, marks), never the bytes: those are its
mover's.  How a copy enters a tier is that tier's own verb, planned by the store and
carried out by the mover pipeline (a write to SSD, a promotion, a copy to the GPU pool).

A tier beyond the four (a second SSD, an archive) registers with ``StoreCore.add_tier``
and keeps its copies in ``Block.extra`` (``{tier name: slot}``): a block with such a
copy is present (lookup finds it there), leaves DRAM without a write (its copy is
below), and its copy is dropped through ``drop`` when the block leaves the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.blocks import Block


class Tier(Protocol):
    """One tier's copies, in the store's terms."""

    name: str

    def holds(self, block: Block) -> bool:
        """Whether the block has a copy in this tier."""
        ...

    def drop(self, block: Block) -> None:
        """The block's copy in this tier goes (the block leaves the store, or the copy
        was found damaged); nothing that pins or moves it may be dropped."""
        ...

    def stats(self) -> dict[str, int]:
        """The tier's figures: capacity, copies, and its counters."""
        ...

    def check(self, blocks: Iterable[Block]) -> None:
        """Assert the tier's share of the invariants over every block of the store
        (conservation of its slots, its orders and marks)."""
        ...
