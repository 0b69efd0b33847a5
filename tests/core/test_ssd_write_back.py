"""The store's side of the remote store's write-back from the SSD tier: which SSD copies
are sent before eviction takes them, and what a failed send or read leaves."""

from __future__ import annotations

from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.store import Block, BlockStore, Namespace

IDENT = make_identity()
SLOT = IDENT.block_bytes


def make_store(ssd_slots: int, *, write_back: bool = True) -> tuple[BlockStore, Namespace]:
    """DRAM of 8 blocks: older blocks live on SSD alone (DRAM drops its clean copies)."""
    store = BlockStore(8 * SLOT, 4 * SLOT, ssd_capacity=ssd_slots * SLOT,
                       ssd_slab_bytes=4 * SLOT)
    if write_back:
        store.remote_write_back = lambda: True
    return store, store.open_namespace(IDENT)


def add(store: BlockStore, ns: Namespace, i: int) -> Block:
    """A one-block chain, committed and written to SSD (evicting an SSD copy if full)."""
    keys = chain_keys(ns.id, [i * 1000 + t for t in range(IDENT.block_tokens)],
                      IDENT.block_tokens)
    r = store.reserve("engine", ns, keys, None, 0.0)
    store.commit("engine", r.id, 0.0)
    block = ns.blocks[keys[0]]
    t, _ = store.ssd_copies.reserve([block])
    store.ssd_copies.finish_write(t, [object()])
    return block


def test_the_copies_sent_are_the_coldest_in_ssd_order_not_the_oldest_written() -> None:
    store, ns = make_store(256)
    blocks = [add(store, ns, i) for i in range(256)]
    for b in blocks[:100]:
        store.lookup(ns, [b.key])        # the oldest written are now the warmest on SSD
    plan = store.ssd_copies.ssd_write_back_plan()
    assert plan and not set(plan) & set(blocks[:100])
    assert plan == blocks[100:100 + len(plan)]  # coldest first
    assert all(b.ssd_holds == 1 for b in plan)
    store.ssd_copies.ssd_write_back_done(plan, [True] * len(plan), [False] * len(plan))
    assert all(b.remote and b.ssd_holds == 0 for b in plan)
    for i in range(1000, 1000 + len(plan)):
        add(store, ns, i)                # each evicts a sent copy, never an unsent one
    assert store.counters.ssd_evictions == len(plan)
    assert store.counters.ssd_evicted_unwritten == 0
    store.check_invariants()


def test_a_small_class_keeps_half_its_copies_free_for_eviction() -> None:
    store, ns = make_store(16)
    blocks = [add(store, ns, i) for i in range(16)]
    plan = store.ssd_copies.ssd_write_back_plan()
    assert 0 < len(plan) <= 8
    add(store, ns, 99)                   # a demotion still finds a victim: no CapacityError
    store.ssd_copies.ssd_write_back_done(plan, [False] * len(plan), [False] * len(plan))
    assert all(b.ssd_holds == 0 for b in blocks)
    assert store.counters.ssd_evicted_unwritten == 1  # that victim had not been sent
    store.check_invariants()


def test_a_copy_that_fails_its_read_is_dropped_and_an_unsent_one_stays() -> None:
    store, ns = make_store(16)
    for i in range(16):
        add(store, ns, i)
    plan = store.ssd_copies.ssd_write_back_plan()
    assert len(plan) >= 2
    bad, unsent = plan[0], plan[1]
    removed = store.ssd_copies.ssd_write_back_done(
        plan, [False] * len(plan), [b is bad for b in plan])
    assert [key for _, key in removed] == [bad.key]
    assert ns.blocks.get(bad.key) is None  # its only copy is gone
    assert store.counters.checksum_failures == 1
    assert unsent.ssd_offset is not None and not unsent.remote and unsent.ssd_holds == 0
    store.check_invariants()


def test_nothing_is_planned_without_the_write_back_mode() -> None:
    store, ns = make_store(16, write_back=False)
    for i in range(16):
        add(store, ns, i)
    assert store.ssd_copies.ssd_write_back_plan() == []
    add(store, ns, 99)
    assert store.counters.ssd_evicted_unwritten == 0  # nothing to send it to
