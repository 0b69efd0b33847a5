"""The store under ``auto`` while a hand-over in slices is under way: blocks kept warm
and released, a policy switch (SIGHUP) or a namespace dropped in the middle, and the
order let go of leaves no block linked to a list it dropped or tracked by a duel it
let go."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from kvtest import make_identity

from kvstore.blocks import Block
from kvstore.keys import chain_keys
from kvstore.scheduler import dueling, handover
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.handover import Handover
from kvstore.scheduler.linked import LinkedOrder
from kvstore.store import BlockStore, Namespace, Pin, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks
SLOTS = 6144
SLOT = 4096


def _duel(store: BlockStore) -> Duel[Block]:
    policy = next(iter(next(iter(store.drams.values())).policies.values()))
    duel = getattr(policy, "inner", policy)
    assert isinstance(duel, Duel)
    return duel


def _orders_of(policy: object) -> set[int]:
    """The ids of the lists an order keeps in the blocks' links, walked down."""
    found: set[int] = set()
    todo = [policy]
    while todo:
        part = todo.pop()
        for value in vars(part).values() if hasattr(part, "__dict__") else ():
            if isinstance(value, list):  # hit density's class lists
                found.update(id(q) for q in value if isinstance(q, LinkedOrder))
            if isinstance(value, LinkedOrder):
                found.add(id(value))
            elif (hasattr(value, "evictable") or hasattr(value, "queues")) and value is not part:
                todo.append(value)  # an order, or a hand-over's parts of the old one
    return found


def _handing_over(monkeypatch: pytest.MonkeyPatch, seed: int
                  ) -> tuple[BlockStore, Namespace, Callable[[], None], list[Pin]]:
    """A store whose duel is part-way through a hand-over, with pins and warm blocks,
    and a request maker for more traffic."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)  # in slices, whatever the size
    monkeypatch.setattr(handover, "BURST", 4)
    monkeypatch.setattr(handover, "PASS_A_BURST", 8)
    rng = random.Random(seed)
    store = BlockStore(SLOTS * SLOT, SLOTS * SLOT, eviction_policy="auto")
    ns = store.open_namespace(IDENT)
    tokens = IDENT.block_tokens
    chains = [chain_keys(ns.id, [c] * (tokens * 40), tokens) for c in range(200)]
    pins: list[Pin] = []
    clock = [0.0]
    requests = [0]

    def put(keys: list[bytes]) -> None:
        r = store.reserve("s", ns, keys, None, clock[0])
        assert isinstance(r, Reservation)
        store.commit("s", r.id, clock[0])

    def request() -> None:
        clock[0] += 1.0
        requests[0] += 1
        roll = rng.random()
        keys = rng.choice(chains)
        if roll < 0.4:
            put(rng.choice(chains[150:] + [keys])[:rng.randrange(1, 40)])
        elif roll < 0.6:
            store.lookup(ns, keys)
        elif roll < 0.75:
            present = [k for k in keys if k in ns.blocks and ns.blocks[k].offset is not None]
            if present:
                pin = store.acquire("s", ns, present[:8], clock[0])
                assert isinstance(pin, Pin)
                pins.append(pin)
        elif roll < 0.85:
            store.keep_warm(ns, keys[:rng.randrange(1, 10)], clock[0] + 5.0)
        elif pins:
            store.release("s", pins.pop(rng.randrange(len(pins))).id)
        if requests[0] % 8 == 0:  # (a walk of every block)
            store.check_invariants()

    for keys in chains[:150]:
        put(keys)
    for keys in chains[:150:2]:
        store.lookup(ns, keys)
    for _ in range(20):
        request()
    duel = _duel(store)
    duel._take_over(1)  # to SLRU
    assert isinstance(duel._order, Handover)
    for _ in range(150):
        request()
    order = duel._order
    assert isinstance(order, Handover) and order.passed, order  # part-way
    return store, ns, request, pins


def _linked_to_current(store: BlockStore, ns: Namespace) -> None:
    """Every block on a list is on one of the policy in charge's lists."""
    current: set[int] = set()
    for dram in store.drams.values():
        for policy in dram.policies.values():
            current |= _orders_of(policy)
    for b in ns.blocks.values():
        if b.dram_order is not None:
            assert id(b.dram_order) in current, f"{b} linked to a list let go"


@pytest.mark.parametrize("to", ["lru", "slru", "auto", "density"])
def test_a_switch_in_the_middle_of_a_hand_over(monkeypatch: pytest.MonkeyPatch,
                                               to: str) -> None:
    store, ns, request, pins = _handing_over(monkeypatch, 3)
    store.set_eviction_policy(to)
    store.check_invariants()
    _linked_to_current(store, ns)
    for _ in range(40):
        request()
    store.check_invariants()
    _linked_to_current(store, ns)
    for pin in pins:
        store.release("s", pin.id)
    store.check_invariants()
    steps = 0
    while store.switch_step(16):  # the change of policy carried through, in steps
        _linked_to_current(store, ns)
        steps += 1
        # The store's whole walk (0.1 s at these 6000 blocks) after the first steps and
        # every 8th of the 281, and after the last: a step that broke a count or a link
        # leaves it broken for the next walk to find (a walk after each step was two
        # thirds of this file's time); the lists let go of are looked for every step.
        if steps < 8 or steps % 8 == 0:
            store.check_invariants()
    assert (steps > 8) == (to != "auto"), f"{steps} steps of a switch to {to}"
    store.check_invariants()
    request()
    store.check_invariants()
    _linked_to_current(store, ns)


def test_a_namespace_dropped_in_the_middle_of_a_hand_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, ns, request, pins = _handing_over(monkeypatch, 5)
    duel = _duel(store)
    for pin in pins:
        store.release("s", pin.id)
    pins.clear()
    store.index.drop_namespace(ns)
    store.check_invariants()
    assert len(duel) == 0
    order = duel._order
    if isinstance(order, Handover):  # no traffic: it waits, holding nothing cached
        assert not order._seen and not order._pinned
