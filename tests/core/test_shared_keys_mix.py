"""A random mix of puts, evictions under pressure, SSD copies, drops and namespaces
forgotten, in namespaces that share keys, with the stream's batches applied to a
router's view (a set of (key, tier), as a router keeps): after each drain the view is
exactly what the namespaces hold, and every map's keys stay counted."""

from __future__ import annotations

import random

import pytest
from kvtest import make_identity

from kvstore.blocks import DRAM, SSD
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Plan, Reservation
from kvstore.tier_changes import Removed, TierChanges, holdings

IDS = [make_identity(tenant=t) for t in ("alice", "mallory", "eve")]
_TIERS = ((DRAM, 1), (SSD, 2))


def _truth(store: BlockStore) -> set[tuple[bytes, str]]:
    return {(key, tier) for ns in store.namespaces.values() for key, b in ns.blocks.items()
            for tier, bit in _TIERS if holdings(b) & bit}


def _apply(view: set[tuple[bytes, str]], changes: TierChanges) -> None:
    for c in changes.drain():
        if isinstance(c, Removed):
            for key in c.keys:
                view.discard((key, c.tier))
        else:
            view.update((b.key, c.tier) for b in c.blocks)


@pytest.mark.parametrize("seed", range(12))
def test_a_router_view_matches_what_the_namespaces_hold(seed: int) -> None:
    rng = random.Random(seed)
    slot = IDS[0].block_bytes
    store = BlockStore(12 * slot, 4 * slot, ssd_capacity=16 * slot, ssd_slab_bytes=4 * slot)
    store.ssd_admit_after = 1 << 20  # (no demotion plans: the test writes SSD copies)
    changes = TierChanges()
    store.record_changes(changes)
    bt = IDS[0].block_tokens
    chains = [chain_keys(b"shared-prefix-16", [c] * (6 * bt), bt) for c in range(3)]
    view: set[tuple[bytes, str]] = set()
    for step in range(300):
        ident = rng.choice(IDS)
        ns = store.open_namespace(ident)
        op = rng.random()
        keys = rng.choice(chains)
        if op < 0.45:
            n = rng.randint(1, 6)
            have = 0
            while have < n and ns.blocks.get(keys[have]) is not None and \
                    ns.blocks[keys[have]].offset is not None:
                have += 1
            if have < n:
                r = store.reserve("o", ns, keys[have:n], keys[have - 1] if have else None,
                                  0.0)
                if isinstance(r, Reservation):
                    store.commit("o", r.id, 0.0)
                else:
                    assert isinstance(r, Plan)
        elif op < 0.6:
            store.index.evict(ns, [rng.choice(keys)])
        elif op < 0.75:
            cands = [b for b in ns.blocks.values() if b.offset is not None
                     and b.ssd_offset is None and not b.refs and not b.demoting]
            if cands:
                b = rng.choice(cands)
                got = store.ssd_copies.reserve([b])
                if got:
                    t, _ = got
                    if t is not None and t.blocks:
                        store.ssd_copies.finish_write(t, [object()] * len(t.blocks))
        elif op < 0.85:
            cands = [b for b in ns.blocks.values() if b.offset is not None and not b.refs
                     and not b.demoting and b.kids is None]
            if cands:
                store.drop_dram_copy(rng.choice(cands))
        else:
            store.index.drop_namespace(ns)
        store.close_namespace(ns)
        store.check_invariants()
        if rng.random() < 0.5:
            _apply(view, changes)
            assert view == _truth(store), f"step {step}"
    _apply(view, changes)
    assert view == _truth(store)
