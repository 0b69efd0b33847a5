"""The snapshot's walk (``kvstore.routing.SnapshotWalk``) against the pure store.

In small pages, with entries dropped and added between them: every block that stays
from the walk's start to its end is listed in each tier it is in, each after its parent,
and nothing gone before the walk began is.
"""

from __future__ import annotations

import random

from kvtest import make_identity

from kvstore.routing import SnapshotWalk
from kvstore.store import BlockStore, Namespace, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)


def commit(store: BlockStore, ns: Namespace, keys: list[bytes], parent: bytes | None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def test_pages_list_every_block_that_stays_parents_first() -> None:
    rng = random.Random(9)
    store = BlockStore(64 << 20, 1 << 20)
    spaces = [store.open_namespace(IDENT), store.open_namespace(make_identity(
        num_layers=1, num_kv_heads=1, head_dim=8, model="other"))]
    chains: list[tuple[Namespace, list[bytes]]] = []
    for ns in spaces:
        for _ in range(30):
            keys = [rng.randbytes(16) for _ in range(40)]
            commit(store, ns, keys, None)
            chains.append((ns, keys))
            commit(store, ns, [rng.randbytes(16) for _ in range(10)], keys[19])  # a branch
    gone_before = chains[0][1][30:]
    store.evict(chains[0][0], [gone_before[0]])
    at_start = {b for ns in spaces for b in ns.blocks.values()}
    walk = SnapshotWalk(store.order, 7)
    out: list[tuple[bytes, bytes | None, str]] = []
    pages = 0
    while not walk.page(rng.randint(1, 60), out):
        pages += 1
        ns, keys = rng.choice(chains)
        if rng.random() < 0.5:  # evict a tail, or grow a chain
            victim = keys[rng.randrange(len(keys))]
            store.evict(ns, [victim])
        else:
            tip = ns.blocks.get(keys[-1])
            if tip is not None:
                commit(store, ns, [rng.randbytes(16) for _ in range(5)], keys[-1])
    assert pages > 50 and walk.seq == 7
    listed = [key for key, _, _ in out]
    assert len(listed) == len(set(listed))  # DRAM only here: once each
    # an entry that left never comes back (a key cached again is a new entry): those
    # there at the start and at the end stayed throughout
    stayed = {b for b in at_start if b.ns.blocks.get(b.key) is b}
    assert len(stayed) < len(at_start) - 100, "too little changed"
    assert {b.key for b in stayed} <= set(listed)
    assert not set(gone_before) & set(listed)
    seen: set[bytes] = set()
    for key, parent, tier in out:
        assert tier == "dram"
        assert parent is None or parent in seen, "a child before its parent"
        seen.add(key)
