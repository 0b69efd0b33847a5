"""The key index's verbs: the longest cached prefix of a chain, and removal of chains.

Lookup walks a chain until the first key with no copy in any tier; removal (evict, drop
a namespace) goes leaf first and spares what is pinned or moving, so a cached key
always implies its whole prefix is cached.  An entry that lost its last copy to
corruption stays as a hollow parent of what depends on it (lookup stops there) until
its children are gone.

A namespace of many blocks is dropped in slices (``NamespaceDrop``), a loop turn each,
so that dropping 400k blocks never holds the daemon's loop for more than a slice.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from kvstore.blocks import DRAM, SEEN_FULL, SEEN_ONE, Block, Namespace
from kvstore.core import Keeping, StoreCore


def leading_present(ns: Namespace, keys: list[bytes]) -> Iterator[Block]:
    """The blocks of the leading keys that have a copy in some tier, in order."""
    for key in keys:
        block = ns.blocks.get(key)
        if block is None or not block.present:
            return
        yield block


def leading_in_dram(ns: Namespace, keys: list[bytes]) -> int:
    """How many of the leading keys have their blocks in DRAM."""
    n = 0
    for block in leading_present(ns, keys):
        if block.offset is None:
            break
        n += 1
    return n


class Index:
    """Chains of one store: lookup, access order, removal."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store
        # A lookup's hits whose orders have not heard of them yet (``lookup(later=True)``):
        # told by ``settle``, which the server calls once the lookup's reply is sent,
        # before anything else runs on the loop.
        self._unsettled: tuple[Namespace, list[Block], int] | None = None

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[bytes], later: bool = False) -> list[str]:
        """The tier of each leading cached key (its length is the hit count).

        ``later``: the eviction orders hear of the hits at the next ``settle``, not now.
        A lookup's reply does not depend on them: the server sends it first, then
        settles, before it handles anything else, so that every later request finds
        the orders as if they had heard at once (the same victims, in the same order),
        and the reply leaves without the orders' work in its round trip (under ``auto``
        about two thirds of a 64-key lookup's time in the store, more after the daemon
        sat idle and the orders' memory went cold)."""
        if self._unsettled is not None:
            self.settle()
        shards, mask = ns.blocks.shards, ns.blocks.mask  # ``ns.blocks.get``, inline
        ssd = self.store.ssd
        ssd_gone = ssd is not None and not ssd.readable  # (its copies not a hit: dropping)
        chain: list[Block] = []
        below = 0  # hits with no DRAM copy
        block: Block | None = None
        for key in keys:
            # The previous key's one child, if it is this key, is this key's entry (a
            # child is in the key map under its key while it hangs there): a chain is
            # walked by its links, one probe of the map at its head (and at each branch
            # point), not one per key.  The map's tables are spread over the heap, the
            # chain's entries lie together, as committed: at 10M blocks a probe costs
            # cache and TLB misses a link does not (``benchmarks/index_scale.py``).
            kids = None if block is None else block.kids
            if kids is not None and kids.__class__ is Block and kids.key == key:
                block = kids
            else:
                block = shards[hash(key) & mask].get(key)
                if block is None:
                    break
            if block.offset is None:
                # ``Block.present``, inline: this loop is the lookup's cost
                if (block.ssd_offset is None or ssd_gone) and block.extra is None:
                    break
                below += 1
            if block.marks < SEEN_FULL:  # ``seen``, ``access``'s count here: one walk
                block.marks += SEEN_ONE
            chain.append(block)
        c = self.store.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        c.hit_blocks += len(chain)
        c.ssd_hits += below
        if chain:
            if later:
                self._unsettled = (ns, chain, below)
            else:
                self._ordered(ns, chain, below)
        if not below:
            return [DRAM] * len(chain)
        return [b.tier for b in chain]

    def settle(self) -> None:
        """Tell the orders of the hits of a lookup made ``later`` (none: nothing to do)."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            self._ordered(*unsettled)

    def _ordered(self, ns: Namespace, chain: list[Block], below: int) -> None:
        """``access``'s orders told of a chain of one namespace (every block of
        ``ns.blocks`` is of ``ns``), whose ``seen`` counts are already up."""
        deepest_first = chain[::-1]
        in_dram = ([b for b in deepest_first if b.offset is not None] if below
                   else deepest_first)
        if in_dram:
            ns.dram.policy(ns.cls).access_many(in_dram)
            ns.dram.note_use(ns.cls, len(in_dram))  # (its class's share of the slabs)
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
            if block.marks < SEEN_FULL:  # (``seen``, without a call)
                block.marks += SEEN_ONE
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
                ns.dram.note_use(ns.cls, len(in_dram))  # (its class's share of the slabs)
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


class NamespaceDrop:
    """``Index.drop_namespace`` in slices: each ``step`` drops a bounded number of blocks,
    so the daemon's loop serves other clients between them.

    What it drops is well defined though the store changes between slices: every block
    the namespace held when the drop was asked for, leaves first, except what is
    pinned, moving or held when the drop reaches it (and so their prefixes), as
    ``drop_namespace`` does; blocks committed since it was asked for are kept (the
    store's commit marks them, whoever commits: ``keeping``, taken when the daemon got
    the request, or here), though it waited before it began, and so are their prefixes.
    A lookup meanwhile sees the chains shortened from their ends, never a hole: a slice
    removes a block only once nothing depends on it.

    How, without a walk of the whole namespace: the key map's shards one at a time (a
    copy of one shard's entries: at most ``block_map.SPLIT_AT``, a few thousand in a big
    namespace), each entry still there dropped if it is a leaf, then its parent if that
    left it one, and so on up.  An entry seen while a child still hangs below it is
    looked at again once its last child goes, whoever removes it (this drop, an evict,
    an eviction under pressure): the store lists such entries for a namespace being
    dropped (``StoreCore.dropping``).  So no entry is dropped before its children, and
    none that became a leaf after the drop passed it is left behind.  Entries the map
    gained since the drop began are found only in shards not yet copied; ``spare``
    keeps them.  ``close`` (or the last step) ends it.
    """

    def __init__(self, store: StoreCore, ns: Namespace, keeping: Keeping | None = None) -> None:
        self.store = store
        self.ns = ns
        self.count = 0  # entries removed so far
        self.removed_ssd: list[tuple[bytes, bytes]] = []  # SSD copies dropped, to hand on
        self._shards = list(ns.blocks.shards)
        self._next = 0  # the next shard to copy
        self._batch: list[Block] = []  # the entries of the shard under way
        self._at = 0
        self._climb: Block | None = None  # where a walk up stopped at a slice's end
        self._keeping = keeping if keeping is not None else store.keep_commits(ns)
        self._leaves: list[Block] = []  # entries that lost their last child: leaves now
        self._keeping.state.walks.append(self._leaves)

    @property
    def spare(self) -> set[Block]:
        """The blocks committed since the drop was asked for: kept (O(those committed
        while any removal of the namespace was open): for tests)."""
        state, mark = self._keeping.state, self._keeping.mark
        return {b for b, asked in state.spare.items() if asked >= mark}

    @property
    def done(self) -> bool:
        return (self._climb is None and not self._leaves and self._at == len(self._batch)
                and self._next == len(self._shards))

    def step(self, budget: int, seconds: float = float("inf")) -> bool:
        """Go through up to ``budget`` entries, stopping early once ``seconds`` have
        passed (looked at every 32 entries); True once the whole namespace has been
        (and the drop is closed)."""
        blocks, removed = self.ns.blocks, self.removed_ssd
        spare, mark = self._keeping.state.spare, self._keeping.mark
        waiting = self._leaves
        drop_leaf = self.store.drop_leaf
        before = len(blocks)
        until = time.perf_counter() + seconds
        visits = 0
        b = self._climb  # a walk up that the last slice stopped in
        while visits < budget:
            if b is None:
                if waiting:
                    b = waiting.pop()
                elif self._at < len(self._batch):
                    b = self._batch[self._at]
                    self._at += 1
                elif self._next < len(self._shards):
                    self._batch = list(self._shards[self._next].values())
                    self._next += 1
                    self._at = 0
                    continue
                else:
                    break
            visits += 1
            if (blocks.get(b.key) is not b or spare.get(b, -1) >= mark
                    or not drop_leaf(b, removed)):
                # gone (its parent, if that is a leaf now, was listed), kept, or not a
                # leaf (it is listed when it becomes one)
                b = None
            else:
                b = b.parent  # dropped: the parent may be a leaf now
            if not visits & 31 and time.perf_counter() > until:
                break
        self._climb = b
        self.count += before - len(blocks)
        if self.done:
            self.close()
            return True
        return False

    def close(self) -> None:
        """The drop is over (or given up): the store stops listing leaves for it, and
        commits are no longer kept for it."""
        walks = self._keeping.state.walks
        if any(leaves is self._leaves for leaves in walks):
            walks[:] = [leaves for leaves in walks if leaves is not self._leaves]
        self._keeping.close()

    def take_removed(self) -> list[tuple[bytes, bytes]]:
        """The SSD copies dropped since the last call (the daemon's mover frees them)."""
        removed, self.removed_ssd = self.removed_ssd, []
        return removed
