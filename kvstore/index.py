"""The key index's verbs: the longest cached prefix of a chain, and removal of chains.

Lookup walks a chain until the first key with no copy in any tier; removal (evict, drop
a namespace) goes leaf first and spares what is pinned or moving, so a cached key
always implies its whole prefix is cached.  An entry that lost its last copy to
corruption stays as a hollow parent of what depends on it (lookup stops there) until
its children are gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.blocks import DRAM, Block, Namespace
from kvstore.core import StoreCore


class Index:
    """Chains of one store: lookup, access order, removal."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading cached key (its length is the hit count)."""
        shards, mask = ns.blocks.shards, ns.blocks.mask  # ``ns.blocks.get``, inline
        chain: list[Block] = []
        below = 0  # hits with no DRAM copy
        for key in keys:
            block = shards[hash(key) & mask].get(key)
            if block is None:
                break
            if block.offset is None:
                # ``Block.present``, inline: this loop is the lookup's cost
                if block.ssd_offset is None and block.extra is None:
                    break
                below += 1
            block.seen += 1  # ``access``'s count, here: one walk of the chain, not two
            chain.append(block)
        c = self.store.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        c.hit_blocks += len(chain)
        c.ssd_hits += below
        if chain:
            self._ordered(ns, chain, below)
        if not below:
            return [DRAM] * len(chain)
        return [b.tier for b in chain]

    def _ordered(self, ns: Namespace, chain: list[Block], below: int) -> None:
        """``access``'s orders told of a chain of one namespace (every block of
        ``ns.blocks`` is of ``ns``), whose ``seen`` counts are already up."""
        deepest_first = chain[::-1]
        in_dram = ([b for b in deepest_first if b.offset is not None] if below
                   else deepest_first)
        if in_dram:
            ns.dram.policy(ns.cls).access_many(in_dram)
        ssd = self.store.ssd
        if ssd is not None:
            on_ssd = [b for b in deepest_first if b.ssd_offset is not None]
            if on_ssd:
                assert ns.ssd_cls is not None, "a namespace with SSD copies has an SSD class"
                ssd.policy(ns.ssd_cls).access_many(on_ssd)

    def access(self, chain: list[Block]) -> None:
        """The blocks were hit: each order they are on hears of it, deepest first, so
        that a parent is always warmer than its children and the cold end of each order
        holds leaves.  One call per order and namespace, not per block."""
        ssd = self.store.ssd
        by_ns: dict[Namespace, tuple[list[Block], list[Block]]] = {}
        for block in reversed(chain):
            block.seen += 1
            lists = by_ns.get(block.ns)
            if lists is None:
                lists = by_ns[block.ns] = ([], [])
            if block.offset is not None:
                lists[0].append(block)
            if block.ssd_offset is not None and ssd is not None:
                lists[1].append(block)
        for ns, (in_dram, on_ssd) in by_ns.items():
            if in_dram:
                ns.dram.policy(ns.cls).access_many(in_dram)
            if on_ssd:
                assert ssd is not None and ns.ssd_cls is not None
                ssd.policy(ns.ssd_cls).access_many(on_ssd)

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
