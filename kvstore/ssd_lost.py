"""The SSD tier's files gone under the daemon (``ssd_watch``): every SSD copy dropped
from the store, and what hung only from them, a slice a loop turn.

Dropping them in one go walked every cached block on the loop: 400k SSD copies held it
for a long time (``benchmarks/ssd_lost_stall.py``), while every verb and housekeeping
holds it a few milliseconds at most.  ``LostCopies`` goes through the namespaces' key
maps a shard at a time, at most ``SLICE`` entries or ``SLICE_SECONDS`` a slice, and
what hangs below a block left with no copy goes leaves first in the same slices
(``SubtreeDrop``).  The store is whole between slices (the invariant check holds), and
the tier is off from the first moment: the tier says it is no longer ``readable``, so a
lookup does not count a copy not yet dropped as a hit, and the mover reads none.
"""

from __future__ import annotations

import time

from kvstore.blocks import Block, Namespace
from kvstore.core import StoreCore, SubtreeDrop

SLICE = 4096  # entries a slice goes through at most (as a drop in slices: ``removals``)
SLICE_SECONDS = 0.001  # and how long it runs at most


class LostCopies:
    """Drops every SSD copy of the store (or of ``blocks`` only) in slices: ``step``
    until it says it is done.  Copies held by a read under way are left, in ``held``,
    for a later round over them."""

    def __init__(self, store: StoreCore, blocks: list[Block] | None = None) -> None:
        assert store.ssd is not None, "a store with an ssd tier"
        store.ssd.readable = False  # (from now on: no lookup counts them, none is read)
        self.store = store
        self.left = store.ssd_committed_slots  # copies there as it began
        self.dropped = 0  # SSD copies dropped so far (below a block left without one too)
        self.slices = 0
        self.largest = 0  # the most entries one slice went through
        self.held: list[Block] = []  # copies a read held: left for a later round
        self._namespaces: list[Namespace] = [] if blocks is not None else list(
            store.namespaces.values())
        self._shards: list[dict[bytes, Block]] = []  # the current namespace's, left
        self._blocks: list[Block] = list(blocks) if blocks is not None else []
        self._walk: tuple[Block, SubtreeDrop] | None = None  # below a block left bare
        self._walk_visits = 0  # entries its last step went through

    def __repr__(self) -> str:
        return (f"LostCopies(dropped={self.dropped}, slices={self.slices}, "
                f"held={len(self.held)})")

    def step(self, budget: int = SLICE, seconds: float = SLICE_SECONDS) -> bool:
        """One slice: up to ``budget`` entries gone through or ``seconds`` spent; True
        once every block has been."""
        store = self.store
        until = time.perf_counter() + seconds
        visits = 0
        done = False
        while visits < budget:
            if visits and not visits & 31 and time.perf_counter() > until:
                break
            if self._walk is not None:
                if not self._walked(budget - visits, until):
                    visits = budget  # (its share used up: the next slice goes on)
                    break
                visits += self._walk_visits
                continue
            if not self._blocks:
                if not self._shards:
                    if not self._namespaces:
                        done = True
                        break
                    self._shards = list(self._namespaces.pop().blocks.shards)
                    continue
                self._blocks = list(self._shards.pop().values())
                visits += 1
                continue
            b = self._blocks.pop()
            visits += 1
            if b.ssd_offset is None:
                continue
            if b.ssd_holds:
                self.held.append(b)
                continue
            store.drop_ssd_copy(b)
            self.dropped += 1
            if not b.present and b.ns.blocks.get(b.key) is b:
                # a hole in the chain: what hangs below it can no longer be found
                self._walk = (b, SubtreeDrop(store, b.ns, [b.key]))
        self.slices += 1
        self.largest = max(self.largest, visits)
        return done

    def _walked(self, budget: int, until: float) -> bool:
        """The walk below a bare block, for up to ``budget`` entries; False if it is not
        over (the slice is)."""
        assert self._walk is not None
        b, walk = self._walk
        if b.ns.blocks.get(b.key) is not b or b.present:
            # given a copy again (committed) since: what hangs below is reachable again
            self._walk, self._walk_visits = None, 0
            walk.close()
            return True
        over = walk.step(max(budget, 1), max(until - time.perf_counter(), 0.0))
        self._walk_visits = walk.visits
        self.dropped += len(walk.take_removed())
        if not over:
            return False
        self._walk = None
        store = self.store
        store.forget_if_gone(b)
        if b.ns.blocks.get(b.key) is b and not b.present:
            store.hollow.add(b)  # something below is in use: dropped when released
        return True

    def close(self) -> None:
        """Given up (the daemon stops)."""
        if self._walk is not None:
            self._walk[1].close()
            self._walk = None
        self._namespaces, self._shards, self._blocks = [], [], []
