"""Tier changes as plain data: which copies blocks gained and lost, for the event stream.

The store marks each block whose copies changed (``TierChanges.touch``: a commit, a
write to SSD, a promotion, a copy dropped, a remote mark, a GPU copy); the daemon drains
the marks once per loop turn and gets, per block, the tiers it gained and lost since the
last drain, compared with what was announced (``Block.announced``, a bit per tier).
Copies that came and went within one turn are never announced, and a block that is
touched twice is announced once.  Nothing here does I/O: the daemon's publisher
(``kvstore.events``) turns the changes into vLLM's KV events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.blocks import DRAM, SSD, Block, Namespace

REMOTE = "remote"
GPU = "gpu"

# One bit per tier, and the tiers fastest first (a lookup reports the fastest).
TIER_BITS: tuple[tuple[str, int], ...] = ((GPU, 8), (DRAM, 1), (SSD, 2), (REMOTE, 4))
# The tiers of each combination of bits, fastest first (drain runs once per loop turn
# over every block that changed: it looks them up rather than test four bits).
_TIERS_OF: tuple[tuple[str, ...], ...] = tuple(
    tuple(tier for tier, bit in TIER_BITS if bits & bit) for bits in range(16))


def holdings(block: Block) -> int:
    """The tiers (bits of ``TIER_BITS``) the block has a copy in now; 0 once it left
    the store."""
    if block.ns.blocks.get(block.key) is not block:
        return 0
    bits = 0
    if block.offset is not None:
        bits |= 1
    if block.ssd_offset is not None:
        bits |= 2
    if block.remote:
        bits |= 4
    if block.gpu_offset is not None:
        bits |= 8
    return bits


@dataclass(eq=False)
class Stored:
    """Blocks of one chain that gained a copy in ``tier``: each block's parent is the
    one before it (the first's is ``blocks[0].parent``)."""

    tier: str
    ns: Namespace
    blocks: list[Block]


@dataclass(eq=False)
class Removed:
    """Keys of one namespace whose copy in ``tier`` went."""

    tier: str
    ns: Namespace
    keys: list[bytes]


Change = Stored | Removed


class TierChanges:
    """The blocks whose copies changed since the last drain.

    ``on_first`` runs when the first block is marked after a drain: the daemon uses it
    to drain once at the end of the loop turn (a plain callable, so the store stays
    free of the loop).
    """

    def __init__(self, on_first: Callable[[], None] | None = None) -> None:
        # Marked blocks in order, a block marked twice listed twice: the drain's second
        # look finds nothing new.  A list, not a set: blocks are equal by key, and a key
        # dropped and cached again in one turn is two entries.
        self.touched: list[Block] = []
        self.on_first = on_first

    def touch(self, block: Block) -> None:
        touched = self.touched
        if not touched and self.on_first is not None:
            self.on_first()
        touched.append(block)

    def touch_all(self, blocks: Iterable[Block]) -> None:
        touched = self.touched
        if not touched and self.on_first is not None:
            self.on_first()
        touched.extend(blocks)

    def __len__(self) -> int:
        return len(self.touched)

    def drain(self) -> list[Change]:
        """What changed since the last drain, removals first (a key dropped and cached
        again in one turn ends up cached), then stores in the order blocks were marked,
        as runs of one chain, one tier and one namespace.  Once per loop turn over every
        block marked: a DRAM copy gained (a commit's) takes the shortest path."""
        touched, self.touched = self.touched, []
        removed: dict[tuple[str, int], Removed] = {}
        stored: list[Stored] = []
        last: dict[str, Stored] = {}  # per tier but DRAM, the run the next may extend
        dram: list[Block] = []        # the DRAM run the next block may extend
        dram_last: Block | None = None
        tiers_of = _TIERS_OF
        for block in touched:
            before = block.announced
            key = block.key
            entries = block.ns.blocks  # ``BlockMap.get``, inline: once per block marked
            if entries.shards[hash(key) & entries.mask].get(key) is block:
                now = 0 if block.offset is None else 1
                if block.ssd_offset is not None:
                    now |= 2
                if block.remote:
                    now |= 4
                if block.gpu_offset is not None:
                    now |= 8
                if now == before:
                    continue
            elif before:
                now = 0
            else:
                continue
            block.announced = now
            new = now & ~before
            if new == 1:  # the common case, a DRAM copy gained (a block's parent is of
                # its namespace: one chain is one namespace)
                if block.parent is dram_last and dram_last is not None:
                    dram.append(block)
                else:
                    dram = [block]
                    stored.append(Stored(DRAM, block.ns, dram))
                dram_last = block
            elif new:
                for tier in tiers_of[new]:
                    if tier == DRAM:
                        if block.parent is dram_last and dram_last is not None:
                            dram.append(block)
                        else:
                            dram = [block]
                            stored.append(Stored(DRAM, block.ns, dram))
                        dram_last = block
                        continue
                    s = last.get(tier)
                    if s is not None and block.parent is s.blocks[-1]:
                        s.blocks.append(block)
                    else:
                        s = last[tier] = Stored(tier, block.ns, [block])
                        stored.append(s)
            gone = before & ~now
            if gone:
                ns = block.ns
                for tier in tiers_of[gone]:
                    run = removed.get((tier, id(ns)))
                    if run is None:
                        run = removed[(tier, id(ns))] = Removed(tier, ns, [])
                    run.keys.append(block.key)
        return [*removed.values(), *stored]
