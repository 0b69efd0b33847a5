"""A change of eviction policy in steps (``scheduler/switch.py``): the store keeps every
block, its pins and warm pins, and its counts, while requests come between the steps
and while a second change comes before the first is through."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.scheduler.eviction import LRUPolicy, WarmPins
from kvstore.scheduler.policy import EvictionPolicy
from kvstore.scheduler.switch import Switch
from kvstore.store import BlockStore, Pin, Reservation

IDENT = make_identity()
POLICIES = ("lru", "slru", "arc", "s3fifo", "density", "auto")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(policy: str, slots: int) -> tuple[BlockStore, Clock]:
    clock = Clock()
    store = BlockStore(slots * IDENT.block_bytes, slots * IDENT.block_bytes,
                       eviction_policy=policy, clock=clock)
    return store, clock


def _commit(store: BlockStore, ns: object, keys: list[bytes]) -> bool:
    r = store.reserve("o", ns, keys, None, 0.0)  # type: ignore[arg-type]
    if not isinstance(r, Reservation):
        return False
    store.commit("o", r.id, 0.0)
    return True


def test_a_switch_under_a_clock_goes_in_steps_and_keeps_every_block() -> None:
    store, _ = _store("auto", 512)
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    chains = [chain_keys(ns.id, list(range(i * 1000, i * 1000 + 8 * bt)), bt)
              for i in range(40)]
    for keys in chains:
        assert _commit(store, ns, keys)
    held = store.acquire("o", ns, chains[3][:4], 0.0)
    assert isinstance(held, Pin)
    store.set_eviction_policy("lru")
    warm = ns.dram.policy(ns.cls)
    assert isinstance(warm, WarmPins) and isinstance(warm.inner, Switch)
    assert store.switches and warm.name == "lru"
    steps = 0
    while store.switch_step(16):
        steps += 1
        store.check_invariants()
    assert steps >= 320 // 16 - 1  # 320 blocks, 16 a step
    assert isinstance(warm.inner, LRUPolicy) and not store.switches
    assert len(ns.blocks) == 320 and len(warm) == 316  # four pinned
    store.release("o", held.id)
    assert len(warm) == 320
    store.check_invariants()
    # the old order's coldest first: the first chains committed go first
    r = store.reserve("o", ns, chain_keys(ns.id, list(range(10**6, 10**6 + 200 * bt)), bt),
                      None, 0.0)
    assert isinstance(r, Reservation)
    assert all(k not in ns.blocks for k in chains[0])
    assert all(k in ns.blocks for k in chains[-1])
    store.check_invariants()


@pytest.mark.parametrize("seed", range(8))
def test_requests_between_steps_and_switches_one_after_another(seed: int) -> None:
    """Random commits, lookups, pins, warm pins, evictions and reserves that must evict,
    between the steps of switches to random policies, a new switch at times before the
    last is through: after each request the store's invariants hold (every block on
    one order or pinned or warm, the counts right, a duel's states on its blocks only);
    at the end the last policy is in charge and every cached block is on it."""
    rng = random.Random(seed)
    start = rng.choice(POLICIES)
    store, clock = _store(start, 96)
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    chains: list[list[bytes]] = []
    pins: list[Pin] = []
    last = start
    for i in range(400):
        clock.now += 0.01
        op = rng.random()
        if op < 0.25 or not chains:
            keys = chain_keys(ns.id, list(range(i * 100, i * 100 + rng.randint(1, 6) * bt)), bt)
            if rng.random() < 0.3 and chains:  # a continuation of a cached chain
                base = rng.choice(chains)
                keys = chain_keys(ns.id, list(range(chains.index(base) * 100,
                                                    chains.index(base) * 100 + 2 * bt))
                                  + list(range(10**7 + i * 50, 10**7 + i * 50 + bt)), bt)
            fresh = [k for k in keys if k not in ns.blocks]
            if fresh and keys[:len(keys) - len(fresh)] == [k for k in keys if k in ns.blocks]:
                parent = keys[len(keys) - len(fresh) - 1] if len(fresh) < len(keys) else None
                r = store.reserve("o", ns, fresh, parent, 0.0)
                if isinstance(r, Reservation):
                    store.commit("o", r.id, 0.0)
                    chains.append(keys)
        elif op < 0.45:
            store.lookup(ns, rng.choice(chains))
        elif op < 0.55:
            keys = [k for k in rng.choice(chains) if k in ns.blocks]
            if keys and ns.blocks[keys[0]].offset is not None:
                try:
                    held = store.acquire("o", ns, keys[:1], 0.0)
                except Exception:
                    held = None
                if isinstance(held, Pin):
                    pins.append(held)
        elif op < 0.65 and pins:
            store.release("o", pins.pop(rng.randrange(len(pins))).id)
        elif op < 0.72:
            store.keep_warm(ns, rng.choice(chains), clock.now + rng.choice((0.02, 0.5)))
        elif op < 0.78:
            store.evict(ns, rng.choice(chains)[-1:])
        elif op < 0.9:
            last = rng.choice(POLICIES)
            store.set_eviction_policy(last)
        else:
            store.switch_step(rng.randint(1, 40))
        store.check_invariants()
    for held in pins:
        store.release("o", held.id)
    while store.switch_step(7):
        store.check_invariants()
    warm = ns.dram.policy(ns.cls)
    assert isinstance(warm, WarmPins) and not isinstance(warm.inner, Switch)
    assert warm.inner.name == last == warm.name
    store.check_invariants()
    cached = {b for b in ns.blocks.values() if b.offset is not None}
    assert set(warm.evictable()) == cached


def _switching(old: LRUPolicy[int], new: EvictionPolicy[int], pinned: Sequence[int] = ()
               ) -> tuple[WarmPins[int], Switch[int]]:
    """``old`` under warm pins (``pinned`` pinned first), switching to ``new``: the pins
    and the switch, which puts ``new`` in charge when it ends."""
    warm = WarmPins(old, lambda: 0.0)
    for item in pinned:
        warm.pin(item)
    switch = Switch(old, new, warm.pinned_inside(), warm.is_pinned_inside, None,
                    lambda order: setattr(warm, "inner", order))
    warm.inner = switch
    return warm, switch


def test_items_hit_during_a_switch_go_after_the_old_orders_items() -> None:
    """Between two LRU orders: with no traffic the victims come in the old order; an
    item hit meanwhile is the warmest, whichever order held it."""
    old = LRUPolicy[int]()
    old.insert_many(range(10))
    warm, switch = _switching(old, LRUPolicy[int]())
    switch.step(3)  # 0, 1, 2 passed to the new order
    warm.access(1)  # in the new order: now warmer than the old order's items
    warm.access(7)  # still in the old one: the warmest
    warm.pin(5)
    victims = [warm.pop_victim(lambda _: True) for _ in range(4)]
    assert victims == [0, 2, 3, 4]
    while not switch.finished:
        switch.step(2)
    assert isinstance(warm.inner, LRUPolicy)
    assert [warm.pop_victim(lambda _: True) for _ in range(4)] == [6, 8, 9, 1]
    assert warm.pop_victim(lambda _: True) == 7 and warm.pop_victim(lambda _: True) is None
    warm.unpin(5)
    assert list(warm.evictable()) == [5]


def test_a_pin_taken_before_the_switch_is_kept_through_it() -> None:
    old = LRUPolicy[int]()
    old.insert_many(range(4))
    warm, switch = _switching(old, LRUPolicy[int](), pinned=[2])
    warm.access(2)  # hit while pinned: stays pinned
    while not switch.finished:
        switch.step(1)
    assert sorted(warm.evictable()) == [0, 1, 3]
    warm.unpin(2)
    assert sorted(warm.evictable()) == [0, 1, 2, 3]
    assert isinstance(warm.inner, LRUPolicy) and isinstance(warm.inner._order, OrderedDict)


def test_a_switch_ends_under_an_ingest_faster_than_the_loop_turns() -> None:
    """Each commit of 2048 items (a cache of 50k, full) with one loop turn of 256 after
    it: the switch passes twice what each call names, so ``fresh`` drains and the new
    order takes charge (a fixed 64 a call left it filling for good)."""
    from kvstore.scheduler.eviction import SLRUPolicy

    old = LRUPolicy[int]()
    old.insert_many(range(50_000))
    warm, switch = _switching(old, SLRUPolicy[int]())
    start = 50_000
    for _ in range(200):
        warm.insert_many(range(start, start + 2048))
        start += 2048
        warm.pop_victims(lambda _: True, len(warm) - 50_000, lambda _: None)
        switch.step(256)
        if switch.finished:
            break
    assert switch.finished and isinstance(warm.inner, SLRUPolicy)
    assert len(warm) == 50_000


def test_a_second_change_while_a_duel_is_let_go_lets_it_go_all_the_same() -> None:
    """``auto`` drained, its tables still being let go, when another SIGHUP comes: the
    new switch takes those steps over, and the duel's release runs (its miniatures
    emptied: a duel dropped unreleased is a cycle the daemon's frozen heap keeps)."""
    from kvstore.scheduler.eviction import AutoPolicy

    store, _ = _store("auto", 4096)
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    for i in range(300):
        assert _commit(store, ns, chain_keys(ns.id, list(range(i * 1000, i * 1000 + 8 * bt)),
                                             bt))
    warm = ns.dram.policy(ns.cls)
    assert isinstance(warm, WarmPins)
    duel = warm.inner
    assert isinstance(duel, AutoPolicy) and duel._minis
    store.set_eviction_policy("lru")
    switch = warm.inner
    assert isinstance(switch, Switch)
    while switch.old is not None:
        store.switch_step(64)
    assert switch._litter and duel._minis  # its leftovers not yet let go
    store.set_eviction_policy("slru")
    while store.switch_step(256):
        store.check_invariants()
    assert duel._minis == [] and not duel._gone
    assert warm.inner.name == "slru"
    store.check_invariants()


def test_hit_density_handed_children_before_parents_links_them() -> None:
    """The old order lists a chain's children colder than their parent (the store
    inserts deepest first): passed in steps, hit density counts each child as its
    parent's once the parent comes, as the one-call switch does."""
    def links(at_once: bool) -> tuple[int, int]:
        store, _ = _store("lru", 4096)
        ns = store.open_namespace(IDENT)
        bt = IDENT.block_tokens
        heads = []
        for i in range(200):
            keys = chain_keys(ns.id, list(range(i * 1000, i * 1000 + 8 * bt)), bt)
            assert _commit(store, ns, keys)
            heads.append(keys[:1])
        store.set_eviction_policy("density", at_once=at_once)
        extra = 0
        while store.switch_step(100):  # traffic between the steps: a hit and a commit
            extra += 1  # (each ends hit density's own wait for late parents)
            store.lookup(ns, heads[extra % len(heads)])
            assert _commit(store, ns, chain_keys(
                ns.id, list(range(10**6 + extra * bt, 10**6 + (extra + 1) * bt)), bt))
        entries = ns.dram.policy(ns.cls).inner._entries  # type: ignore[attr-defined]
        unlinked = sum(1 for b in ns.blocks.values()
                       if b.parent is not None and b.parent in entries and entries[b].up is None)
        with_kids = sum(1 for b in ns.blocks.values() if b in entries and entries[b].kids)
        return unlinked, with_kids

    assert links(True) == links(False) == (0, 200 * 7)
