"""The key index's verbs: the longest cached prefix of a chain, and removal of chains.

Lookup walks a chain until the first key with no copy in any tier; removal (evict, drop
a namespace) goes leaf first and spares what is pinned or moving, so a cached key
always implies its whole prefix is cached.  An entry that lost its last copy to
corruption stays as a hollow parent of what depends on it (lookup stops there) until
its children are gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.blocks import Block, Namespace
from kvstore.core import StoreCore


class Index:
    """Chains of one store: lookup, access order, removal."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading cached key (its length is the hit count)."""
        blocks = ns.blocks
        chain: list[Block] = []
        for key in keys:
            block = blocks.get(key)
            if block is None or not block.present:
                break
            chain.append(block)
        c = self.store.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        c.hit_blocks += len(chain)
        c.ssd_hits += sum(1 for b in chain if b.offset is None)
        self.access(chain)
        return [b.tier for b in chain]

    def access(self, chain: list[Block]) -> None:
        # Deepest first, so that a parent is always warmer than its children and the
        # cold end of each order holds leaves.
        for block in reversed(chain):
            block.seen += 1
            if block.offset is not None:
                block.ns.dram.policy(block.ns.cls).access(block)
            if block.ssd_offset is not None and self.store.ssd is not None:
                assert block.ns.ssd_cls is not None
                self.store.ssd.policy(block.ns.ssd_cls).access(block)

    def evict(self, ns: Namespace, keys: Iterable[bytes]) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Drop the given blocks and what depends on them, from every tier, except what is
        pinned or moving; returns (entries removed, keys whose SSD copy went)."""
        removed_ssd: list[tuple[bytes, bytes]] = []
        before = len(ns.blocks)
        for key in keys:
            block = ns.blocks.get(key)
            if block is not None:
                self.store.drop_subtree(ns, [block], removed_ssd)
        return before - len(ns.blocks), removed_ssd

    def drop_namespace(self, ns: Namespace) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Drop every block of a namespace that is not pinned or moving."""
        removed_ssd: list[tuple[bytes, bytes]] = []
        before = len(ns.blocks)
        self.store.drop_subtree(ns, [b for b in ns.blocks.values() if b.parent is None], removed_ssd)
        return before - len(ns.blocks), removed_ssd
