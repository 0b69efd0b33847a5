"""The store's DRAM order under ``auto`` handed over in slices, with the store's own
traffic (commits that evict, lookups, pins and releases, evictions asked for) between
the slices: the store's invariants hold after every request, nothing is evicted while
pinned, and the hand-over ends with every cached block on the new order."""

from __future__ import annotations

import random

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.scheduler import dueling
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler import handover
from kvstore.scheduler.handover import Handover
from kvstore.store import BlockStore, Pin, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks
AT_ONCE = 2048  # the one-call hand-over's size here (its own is larger: a faster test)
SLOTS = 3 * AT_ONCE
SLOT = 4096  # the smallest slot


def test_a_hand_over_in_slices_keeps_the_store_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", AT_ONCE)
    monkeypatch.setattr(handover, "BURST", 4)  # small steps: many requests between
    monkeypatch.setattr(handover, "PASS_A_BURST", 8)
    rng = random.Random(4)
    store = BlockStore(SLOTS * SLOT, SLOTS * SLOT, eviction_policy="auto")
    ns = store.open_namespace(IDENT)
    tokens = IDENT.block_tokens
    chains = [chain_keys(ns.id, [c] * (tokens * 40), tokens) for c in range(200)]

    def put(keys: list[bytes]) -> None:
        r = store.reserve("s", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("s", r.id, 0.0)

    for keys in chains[:150]:  # 6000 blocks: more than the one-call size, DRAM nearly full
        put(keys)
    policy = next(iter(next(iter(store.drams.values())).policies.values()))
    duel = getattr(policy, "inner", policy)
    assert isinstance(duel, Duel) and duel.leader == "lru"
    for keys in chains[:150:2]:
        store.lookup(ns, keys)  # hit since they entered: protected once handed over
    evicted = store.stats()["evictions"]
    duel._take_over(1)  # to SLRU
    handing = duel._order
    assert isinstance(handing, Handover) and duel.leader == "slru"
    pins: list[Pin] = []
    requests = 0
    while isinstance(duel._order, Handover):
        roll = rng.random()
        keys = rng.choice(chains)
        if roll < 0.4:  # new chains (and old ones back) evict
            put(rng.choice(chains[150:] + [keys])[:rng.randrange(1, 40)])
        elif roll < 0.7:
            store.lookup(ns, keys)
        elif roll < 0.85:
            present = [k for k in keys if k in ns.blocks and ns.blocks[k].offset is not None]
            if present:
                pin = store.acquire("s", ns, present[:8], 0.0)
                assert isinstance(pin, Pin)
                pins.append(pin)
        elif pins:
            store.release("s", pins.pop(rng.randrange(len(pins))).id)
        store.check_invariants()
        requests += 1
        assert requests < 5000, handing
    assert handing.finished and duel.leader == "slru"
    assert store.stats()["evictions"] > evicted + 1000  # victims picked meanwhile
    assert handing.passed >= 4000  # every block then cached, and those since
    for pin in pins:
        store.release("s", pin.id)
    store.check_invariants()
    cached = sum(1 for b in ns.blocks.values() if b.offset is not None)
    assert len(duel) == cached  # none pinned now: every DRAM block on the order
