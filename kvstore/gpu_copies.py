"""Which blocks have a copy in the GPU tier's device pool, and where: pure bookkeeping.

The GPU tier mirrors hot DRAM blocks: the daemon copies a committed block's DRAM slot
into a slot of its device pool, and colocated engines on that GPU then reload it device
to device instead of from host memory.  DRAM stays the block's home: a GPU copy exists
only while the DRAM copy does (it goes when the DRAM copy goes), and a copy of a pinned
block is never taken, since the pin's holder may be reading it.  Cold copies give way to
new ones, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstore.errors import TooLargeError
from kvstore.pool import SlabPool

if TYPE_CHECKING:
    from kvstore.blocks import Block
    from kvstore.tier_changes import TierChanges


class GpuCopies:
    """The device pool's slots and the blocks whose bytes sit in them (a ``Tier``)."""

    name = "gpu"

    def __init__(self, capacity_bytes: int, slab_bytes: int, alignment: int = 256) -> None:
        self.pool = SlabPool(capacity_bytes, slab_bytes, alignment)
        self.order: OrderedDict[Block, None] = OrderedDict()  # visible copies, coldest first
        self.copying: dict[Block, int] = {}                   # slot taken, bytes on their way
        self.copies = 0
        self.evictions = 0
        self.refused = 0
        self.changes: TierChanges | None = None  # marks for the event stream (when on)

    def plan(self, blocks: Iterable[Block]) -> list[tuple[Block, int]]:
        """Slots for the blocks (with a DRAM copy) that have no GPU copy yet, giving up
        cold unpinned copies for them; stops at the first that finds no room."""
        out: list[tuple[Block, int]] = []
        for b in dict.fromkeys(blocks):
            if b.offset is None or b.gpu_offset is not None or b in self.copying:
                continue
            slot = self._take(b)
            if slot is None:
                self.refused += 1
                break
            self.copying[b] = slot
            out.append((b, slot))
        return out

    def _take(self, block: Block) -> int | None:
        try:
            cls = self.pool.class_for(block.ns.block_bytes)
        except TooLargeError:
            return None
        while (got := self.pool.allocate(cls, 1)) is None:
            # a copy of the same size frees a slot at once; another size, once its slab
            # empties and returns to the pool
            victim = fallback = None
            for v in self.order:
                if v.refs:
                    continue
                if self.pool.class_for(v.ns.block_bytes) is cls:
                    victim = v
                    break
                fallback = fallback or v
            victim = victim or fallback
            if victim is None:
                return None
            self.drop(victim)
            self.evictions += 1
        return got[0]

    def finish(self, block: Block, ok: bool) -> None:
        """The copy into the block's slot ended; a good one becomes visible, unless the
        DRAM copy went meanwhile."""
        slot = self.copying.pop(block)
        if ok and block.offset is not None and block.ns.blocks.get(block.key) is block:
            block.gpu_offset = slot
            self.order[block] = None
            self.copies += 1
            if self.changes is not None:
                self.changes.touch(block)
        else:
            self.pool.free(self.pool.class_for(block.ns.block_bytes), [slot])

    def holds(self, block: Block) -> bool:
        return block.gpu_offset is not None

    def drop(self, block: Block) -> None:
        """Free the block's GPU copy (its DRAM copy is going, or room is needed)."""
        if block.gpu_offset is None:
            return
        assert block.refs == 0 or block.offset is not None, f"{block}: pinned copy dropped"
        self.pool.free(self.pool.class_for(block.ns.block_bytes), [block.gpu_offset])
        block.gpu_offset = None
        self.order.pop(block, None)
        if self.changes is not None:
            self.changes.touch(block)

    def touch(self, blocks: Iterable[Block]) -> None:
        """The blocks were used: their copies go to the warm end."""
        for b in blocks:
            if b.gpu_offset is not None:
                self.order.move_to_end(b)

    def offsets(self, blocks: Iterable[Block]) -> list[int]:
        """Each block's GPU slot, -1 for none."""
        return [b.gpu_offset if b.gpu_offset is not None else -1 for b in blocks]

    def check(self, blocks: Iterable[Block]) -> None:
        """Every slot is free, being copied into, or held by exactly one visible copy."""
        self.pool.check()
        visible = [b for b in blocks if b.gpu_offset is not None]
        assert set(visible) == set(self.order), "visible gpu copies and the order disagree"
        for b in visible:
            assert b.offset is not None, f"{b} has a gpu copy but no dram copy"
        slots = [b.gpu_offset for b in visible] + list(self.copying.values())
        assert len(set(slots)) == len(slots), "a gpu slot is held twice"
        used = sum(cls.capacity_slots - cls.free_slots for cls in self.pool.classes.values())
        assert used == len(slots), f"{used} gpu slots in use, {len(slots)} accounted for"

    def stats(self) -> dict[str, int]:
        return {"capacity": self.pool.capacity_bytes, "blocks": len(self.order),
                "copying": len(self.copying), "copies": self.copies,
                "evictions": self.evictions, "refused": self.refused}

    def __repr__(self) -> str:
        return (f"GpuCopies(blocks={len(self.order)}, copying={len(self.copying)}, "
                f"capacity={self.pool.capacity_bytes})")
