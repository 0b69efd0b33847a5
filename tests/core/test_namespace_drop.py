"""A namespace dropped in slices (``kvstore.index.NamespaceDrop``) against the pure store.

Between slices the store goes on changing, as the daemon's loop serves other clients:
commits into the namespace, pins, evictions.  Each slice must leave the invariants whole,
remove leaves before their parents, keep what is pinned and what was committed after the
drop began (and their prefixes), and end with what the one-go ``drop_namespace`` leaves.
"""

from __future__ import annotations

import random

from kvtest import make_identity

from kvstore.index import NamespaceDrop
from kvstore.store import Block, BlockStore, Namespace, Pin, Plan, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks


def fill(store: BlockStore, ns: Namespace, rng: random.Random, chains: int,
         length: int) -> list[list[bytes]]:
    """``chains`` trees: each a chain with a branch off its middle (a branch point)."""
    out = []
    for _ in range(chains):
        keys = [rng.randbytes(16) for _ in range(length)]
        r = store.reserve("w", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
        branch = [rng.randbytes(16) for _ in range(length // 2)]
        r = store.reserve("w", ns, branch, keys[length // 2 - 1], 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
        out += [keys, keys[:length // 2] + branch]
    return out


def new_store() -> tuple[BlockStore, Namespace]:
    store = BlockStore(64 << 20, 1 << 20)
    return store, store.open_namespace(IDENT)


def test_a_drop_in_small_slices_ends_as_the_one_go_drop() -> None:
    rng = random.Random(5)
    a, ns_a = new_store()
    b, ns_b = new_store()
    chains_a = fill(a, ns_a, random.Random(1), 40, 64)
    fill(b, ns_b, random.Random(1), 40, 64)
    pin = a.acquire("reader", ns_a, chains_a[3][:10], 0.0)
    b.acquire("reader", ns_b, chains_a[3][:10], 0.0)
    assert isinstance(pin, Pin)
    drop = NamespaceDrop(a, ns_a)
    slices = 0
    while not drop.step(rng.randint(1, 300)):
        slices += 1
        a.check_invariants()
        # never a hole: every entry's parent is an entry
        for block in ns_a.blocks.values():
            assert block.parent is None or ns_a.blocks.get(block.parent.key) is block.parent
    assert slices > 10, "the slices were not small"
    count, _ = b.drop_namespace(ns_b)
    assert drop.count == count == 40 * 96 - 10
    assert sorted(ns_a.blocks) == sorted(ns_b.blocks) == sorted(chains_a[3][:10])
    a.check_invariants()


def test_what_is_committed_during_the_drop_is_kept_with_its_prefix() -> None:
    store, ns = new_store()
    rng = random.Random(2)
    chains = fill(store, ns, rng, 30, 32)
    drop = NamespaceDrop(store, ns)
    assert not drop.step(200)
    # a commit onto an old chain's prefix, and a new chain, while the drop is under way
    onto = next(c for c in chains if ns.blocks.get(c[5]) is not None)
    more = [rng.randbytes(16) for _ in range(4)]
    r = store.reserve("w", ns, more, onto[5], 0.0)
    assert isinstance(r, Reservation)
    fresh = store.commit("w", r.id, 0.0).blocks
    alone = [rng.randbytes(16) for _ in range(3)]
    r = store.reserve("w", ns, alone, None, 0.0)
    assert isinstance(r, Reservation)
    fresh += store.commit("w", r.id, 0.0).blocks
    assert drop.spare == set(fresh)  # the store's commit kept them, whoever commits
    while not drop.step(150):
        store.check_invariants()
    kept = set(ns.blocks)
    assert kept == set(onto[:6]) | set(more) | set(alone)
    assert drop.count == 30 * 48 - 6
    # a second drop, after it, takes what the first kept
    second = NamespaceDrop(store, ns)
    while not second.step(5):
        pass
    assert second.count == len(kept) and not ns.blocks
    store.check_invariants()


def test_blocks_evicted_and_pinned_between_slices() -> None:
    store, ns = new_store()
    rng = random.Random(3)
    chains = fill(store, ns, rng, 50, 40)
    drop = NamespaceDrop(store, ns)
    held: list[Pin] = []
    evicted = 0
    while not drop.step(100):
        store.check_invariants()
        live = [c for c in chains if ns.blocks.get(c[0]) is not None]
        if not live:
            continue
        chain = rng.choice(live)
        lead = 0
        while lead < len(chain) and ns.blocks.get(chain[lead]) is not None:
            lead += 1
        if rng.random() < 0.5:
            before = len(ns.blocks)
            store.evict(ns, [chain[lead - 1]])
            evicted += before - len(ns.blocks)
        elif len(held) < 5:
            pin = store.acquire("reader", ns, chain[:lead], 0.0)
            assert isinstance(pin, Pin)
            held.append(pin)
    kept = {k for pin in held for k in (b.key for b in pin.blocks)}
    assert set(ns.blocks) == kept
    assert drop.count + evicted == 50 * 60 - len(kept)
    for pin in held:
        store.release("reader", pin.id)
    store.check_invariants()


def test_the_ssd_copies_it_drops_are_handed_on_and_moving_blocks_are_spared() -> None:
    store = BlockStore(64 << 20, 1 << 20, ssd_capacity=64 << 20, ssd_slab_bytes=1 << 20)
    ns = store.open_namespace(IDENT)
    rng = random.Random(4)
    keys = [rng.randbytes(16) for _ in range(50)]
    r = store.reserve("w", ns, keys, None, 0.0)
    assert not isinstance(r, Plan)
    blocks: list[Block] = store.commit("w", r.id, 0.0).blocks
    t, _ = store.ssd_copies.reserve(blocks[30:])  # written through: a copy in both tiers
    store.ssd_copies.finish_write(t, [None] * 20)
    moving, _ = store.ssd_copies.reserve(blocks[10:12])  # a write under way
    drop = NamespaceDrop(store, ns)
    removed = []
    while not drop.step(7):
        removed += drop.take_removed()
        store.check_invariants()
    removed += drop.take_removed()
    assert sorted(k for _, k in removed) == sorted(keys[30:]) and drop.take_removed() == []
    assert {nid for nid, _ in removed} == {ns.id}
    assert set(ns.blocks) == set(keys[:12])  # what is being written, and its prefix, stays
    assert drop.count == 38
    store.ssd_copies.finish_write(moving, None)
    store.check_invariants()


def test_what_becomes_a_leaf_after_the_drop_passed_it_goes_too() -> None:
    """A big namespace (its key map split into shards: no order of parents first), its
    chains cut short between slices by evictions: the parents that became leaves after
    the drop passed them are dropped too, and nothing is left but what is pinned."""
    store = BlockStore(256 << 20, 1 << 20)
    ns = store.open_namespace(IDENT)
    rng = random.Random(6)
    chains = []
    for _ in range(36):
        keys = [rng.randbytes(16) for _ in range(1000)]
        r = store.reserve("w", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
        chains.append(keys)
    assert len(ns.blocks.shards) > 1
    pin = store.acquire("reader", ns, chains[0][:5], 0.0)
    assert isinstance(pin, Pin)
    drop = NamespaceDrop(store, ns)
    evicted = 0
    while not drop.step(300):
        chain = rng.choice(chains)
        key = chain[rng.randrange(5, len(chain))]
        before = len(ns.blocks)
        store.evict(ns, [key])
        evicted += before - len(ns.blocks)
    assert evicted > 1000, "the evictions cut too little"
    assert set(ns.blocks) == set(chains[0][:5])
    assert drop.count + evicted == 36 * 1000 - 5
    assert ns not in store.dropping  # closed with its last step
    store.release("reader", pin.id)
    store.check_invariants()
