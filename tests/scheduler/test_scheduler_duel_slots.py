"""The duel's tracked items' states kept in the items themselves (``SlotStates``, the
store's blocks' ``dram_duel``) against the same duel over plain ints (``MapStates``):
one random life of a cache, the same victims, hand-overs, hits and states; and a duel
let go of leaves no state behind for the next one."""

from __future__ import annotations

import random
from collections.abc import Hashable
from operator import attrgetter
from typing import Any

import pytest

from kvstore.scheduler.eviction import AutoPolicy, WarmPins
from kvstore.scheduler.tracked import MapStates, SlotStates


class _Slotted:
    """A store block in miniature: a key, a parent, its links and its duel state."""

    __slots__ = ("key", "parent", "dram_duel", "dram_order", "dram_older", "dram_newer")

    def __init__(self, key: int, parent: _Slotted | None) -> None:
        self.key = key
        self.parent = parent
        self.dram_duel: bool | int | None = None
        self.dram_order = self.dram_older = self.dram_newer = None

    def __hash__(self) -> int:
        # the int's own hash: a set of these lists them as the same set of ints (the
        # duel's pinned set is listed at a hand-over)
        return hash(self.key)

    def __repr__(self) -> str:
        return f"_Slotted({self.key})"


class _Linked:
    """The same with links but no attribute for the duel's state."""

    __slots__ = ("key", "parent", "dram_order", "dram_older", "dram_newer")

    def __init__(self, key: int, parent: _Linked | None) -> None:
        self.key = key
        self.parent = parent
        self.dram_order = self.dram_older = self.dram_newer = None


def _duel(slotted: bool) -> AutoPolicy[Any]:
    duel: AutoPolicy[Any] = AutoPolicy(sample_shift=1, epoch=24, shortest=4)
    if slotted:
        duel.ghost_key = attrgetter("key")  # names the same as the ints'
        duel.links = "dram"
    return duel


def _name(item: Any) -> Any:
    return item.key if isinstance(item, _Slotted) else item


def _run(slotted: bool, seed: int) -> list[str]:
    """A random life of a cache of 250 items: chains committed deepest first (in one
    call or item by item, some holding items tracked already), hits one by one and
    in runs, pins held a while, removals, evictions some items refuse; every decision
    and the duel's state recorded, items by their ints."""
    rng = random.Random(seed)
    duel = _duel(slotted)
    parent_of: dict[Hashable, Hashable | None] = {}
    if not slotted:
        duel.parent_of = parent_of.get
    made: list[Any] = []
    held: list[Any] = []
    pinned: list[Any] = []
    seen: list[Any] = []
    for step in range(500):
        size = rng.choice((1, 2, 5, 17, 40))
        parent = rng.choice(made) if made and rng.random() < 0.3 else None
        chain: list[Any] = []
        for i in range(size):
            key = len(made) * 5 + i + 1
            if slotted:
                parent = _Slotted(key, parent)
            else:
                parent_of[key] = parent
                parent = key
            chain.append(parent)
        made.extend(chain)
        refuse = rng.randrange(4)
        while len(held) + len(chain) > 250:
            victim = duel.pop_victim(lambda i: bool(_name(i) % 4 != refuse))
            seen.append(("victim", _name(victim)))
            if victim is None:
                break
            held.remove(victim)
        batch = list(reversed(chain))
        if held and rng.random() < 0.1:
            batch.insert(rng.randrange(len(batch) + 1), rng.choice(held))  # tracked
        if rng.random() < 0.3:
            for item in batch:
                duel.insert(item)
        else:
            duel.insert_many(batch)
        held.extend(chain)
        # mostly the oldest held (a hot set that a scan-resistant order keeps), some any
        pool = held[:60] if rng.random() < 0.8 else held
        hits = rng.sample(pool, min(len(pool), rng.randrange(0, 40)))
        duel.access_many(hits)
        if held:
            duel.access(rng.choice(held))
        roll = rng.random()
        if roll < 0.15 and held:
            item = rng.choice(held)
            duel.pin(item)
            pinned.append(item)
        elif roll < 0.3 and pinned:
            duel.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif roll < 0.4 and held:
            item = rng.choice(held)
            if item not in pinned:
                duel.remove(item)
                held.remove(item)
        seen.append((step, duel.leader, duel.switches, duel._tick, duel._size,
                     len(duel._items), duel.scores()))
    seen.append(sorted((_name(i), duel._items.get(i)) for i in made
                       if duel._items.get(i) is not None))
    seen.append([_name(i) for i in duel.evictable()])
    return [repr(entry) for entry in seen]


@pytest.mark.parametrize("seed", [1, 2, 3, 5])
def test_states_in_the_items_decide_as_states_in_a_map(seed: int) -> None:
    slotted, plain = _run(True, seed), _run(False, seed)
    assert slotted == plain
    assert any("victim" in entry for entry in slotted)
    leaders = {entry.split(", ")[1] for entry in slotted if entry.startswith("(")
               and not entry.startswith("('victim'")}
    assert leaders - {"'lru'"}, "the duel handed its order over at least once"


def test_the_items_kind_decides_where_states_live() -> None:
    duel = _duel(True)
    items = [_Slotted(k, None) for k in range(20)]
    duel.insert_many(items)
    assert isinstance(duel._items, SlotStates) and len(duel._items) == 20
    assert all(i.dram_duel is not None for i in items)
    linked = _duel(True)  # links, but no attribute for the state: a map
    linked.insert_many([_Linked(k, None) for k in range(20)])
    assert isinstance(linked._items, MapStates) and len(linked._items) == 20
    ints: AutoPolicy[Any] = AutoPolicy()
    ints.insert_many(range(20))
    assert isinstance(ints._items, MapStates)


def test_evicted_and_removed_items_are_untracked_in_themselves() -> None:
    duel = _duel(True)
    items = [_Slotted(k, None) for k in range(8)]
    duel.insert_many(items)
    duel.remove(items[3])
    victim = duel.pop_victim(lambda _: True)
    assert victim is items[0]
    assert items[0].dram_duel is None and items[3].dram_duel is None
    assert len(duel._items) == 6
    duel.insert(items[0])  # back again: tracked anew
    assert items[0].dram_duel is not None and len(duel._items) == 7


def test_a_duel_let_go_of_unsets_every_state_pinned_ones_too() -> None:
    """A policy switch (``release``, then a new duel inserts the same blocks): the old
    duel's states would make the new one take its items for tracked already."""
    items = [_Slotted(k, None) for k in range(30)]
    old = WarmPins(_duel(True), clock=lambda: 0.0)
    old.insert_many(items)
    old.access_many(items[:10])
    old.pin(items[4])
    old.release()
    assert all(i.dram_duel is None and i.dram_order is None for i in items)
    new = _duel(True)
    new.insert_many(items)
    assert len(new._items) == 30 and list(new.evictable()) == items
    assert new.pop_victim(lambda _: True) is items[0]
