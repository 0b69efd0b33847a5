"""What a clean stop writes to the SSD tier under write-back (``ssd_copies.flush_plan``):
blocks only DRAM holds, as many as each class has slots (no class counting the empty
slabs another takes), parents first, and first the parents that copies already on SSD
hang from (without them a restart drops those copies as orphans)."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet

from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.slab_moves import StopTrades
from kvstore.ssd_flush import flush_plan
from kvstore.store import Block, BlockStore, Namespace

IDENT = make_identity()
SLOT = IDENT.block_bytes


def commit(store: BlockStore, ns: Namespace, first: int, blocks: int) -> list[Block]:
    keys = chain_keys(ns.id, range(first, first + blocks * IDENT.block_tokens),
                      IDENT.block_tokens)
    r = store.reserve("engine", ns, keys, None, 0.0)
    store.commit("engine", r.id, 0.0)
    return [ns.blocks[k] for k in keys]


def on_ssd(store: BlockStore, blocks: list[Block]) -> None:
    t, _ = store.ssd_copies.reserve(blocks)
    store.ssd_copies.finish_write(t, [object()] * len(blocks))


def test_parents_of_copies_on_ssd_come_first() -> None:
    store = BlockStore(64 * SLOT, 8 * SLOT, ssd_capacity=16 * SLOT, ssd_slab_bytes=4 * SLOT)
    other = store.open_namespace(make_identity(salt="other"))  # first in the store's order
    ns = store.open_namespace(IDENT)
    loose = commit(store, other, 0, 12)  # only in DRAM, and first in the store's order
    chain = commit(store, ns, 10**6, 8)
    on_ssd(store, chain[1:])  # its head only in DRAM, the rest on SSD as well
    plan = flush_plan(store.ssd_copies)
    # the head the seven copies hang from, first (before, the loose blocks took the
    # room); then the rest, as many as the class has slots (16: what the flush may
    # write where there is room or in place of a leaf)
    assert plan[0] is chain[0]
    assert plan[1:] == loose
    store.check_invariants()


def test_two_block_sizes_share_the_empty_slabs_once() -> None:
    store = BlockStore(64 * SLOT, 8 * SLOT, ssd_capacity=8 * SLOT, ssd_slab_bytes=4 * SLOT)
    big = store.open_namespace(IDENT)
    small = store.open_namespace(make_identity(head_dim=IDENT.head_dim // 2))
    commit(store, big, 0, 6)
    commit(store, small, 10**6, 6)
    plan = flush_plan(store.ssd_copies)
    assert store.ssd is not None
    # two empty slabs of four big slots or eight small ones: the big blocks (first)
    # take both, and none is left for the small (each class counted both slabs, and the
    # plan held more than the tier)
    room = sum(b.ns.ssd_cls.slot_bytes for b in plan if b.ns.ssd_cls is not None)
    assert room <= 8 * SLOT
    assert [b.ns for b in plan].count(big) == 6 and [b.ns for b in plan].count(small) == 0


def test_a_size_with_no_room_takes_at_most_half_of_anothers_slabs_and_goes_first() -> None:
    store = BlockStore(256 * SLOT, 8 * SLOT, ssd_capacity=16 * SLOT, ssd_slab_bytes=4 * SLOT)
    big = store.open_namespace(IDENT)
    small = store.open_namespace(make_identity(head_dim=IDENT.head_dim // 2))
    on_ssd(store, commit(store, big, 0, 16))  # the tier's four slabs: the big size's
    loose = commit(store, big, 10**6, 4)
    smalls = commit(store, small, 2 * 10**6, 40)  # more than two slabs of eight hold
    plan = flush_plan(store.ssd_copies)
    # two of the big size's four slabs (16 small slots), the small blocks first (their
    # slabs are emptied before the flush writes big blocks into them), parents first
    assert plan[:16] == smalls[:16]
    assert plan[16:] == loose
    store.check_invariants()


class Asked(AbstractSet[Block]):
    """The flush's planned blocks (every block only DRAM holds: millions), as a set that
    may be asked about but not walked: each slab traded copied them all, on the loop."""

    def __init__(self, blocks: list[Block]) -> None:
        self._blocks = set(blocks)
        self.asked = 0

    def __contains__(self, b: object) -> bool:
        self.asked += 1
        return b in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        raise AssertionError("the flush's planned blocks were walked (copied)")


def test_a_slab_traded_on_the_way_out_asks_the_planned_blocks_never_copies_them() -> None:
    store = BlockStore(256 * SLOT, 8 * SLOT, ssd_capacity=16 * SLOT, ssd_slab_bytes=4 * SLOT)
    big = store.open_namespace(IDENT)
    small = store.open_namespace(make_identity(head_dim=IDENT.head_dim // 2))
    on_ssd(store, commit(store, big, 0, 16))  # the tier's four slabs: the big size's
    smalls = commit(store, small, 2 * 10**6, 8)
    assert store.ssd is not None
    planned = Asked(smalls)
    trades = StopTrades(lambda _b: False, StopTrades.spare_of(store.ssd.pool), planned)
    t, _ = store.ssd_copies.reserve(smalls, evict=trades)  # a big slab, given for them
    assert planned.asked > 0 and trades.spare[SLOT] == 1
    store.ssd_copies.finish_write(t, [object()] * len(smalls))
    assert all(b.ssd_offset is not None for b in smalls)
    store.check_invariants()
