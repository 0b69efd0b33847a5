"""``pop_victims`` (a request's victims in one call) against ``pop_victim`` one after
another, for every policy, over plain items and the store's linked ones, with and
without soft pins: one random life of a cache each way, the same victims in the same
order, the same order left behind, the same duel (scores, leader, clock)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.scheduler.eviction import POLICIES, WarmPins, make_policy
from kvstore.scheduler.linked import LinkedOrder, linked_order
from kvstore.scheduler.policy import GO_ON, EvictionPolicy


class _Item:
    """A block in miniature: a key, a parent, its links, its duel state."""

    __slots__ = ("key", "parent", "kids", "dram_duel", "dram_order", "dram_older",
                 "dram_newer")

    def __init__(self, key: int, parent: _Item | None) -> None:
        self.key = key
        self.parent = parent
        self.kids = 0
        self.dram_duel: bool | int | None = None
        self.dram_order = self.dram_older = self.dram_newer = None

    def __hash__(self) -> int:
        return hash(self.key)  # listed in the same order in both lives

    def __repr__(self) -> str:
        return f"_Item({self.key})"


class _Life:
    """A cache of chains whose leaves leave first; ``batched``: victims by
    ``pop_victims``, else by ``pop_victim`` one by one."""

    def __init__(self, name: str, linked: bool, warm: bool, batched: bool) -> None:
        self.clock = 0.0
        policy = make_policy(name, ghost_key=lambda item: item.key,
                             links="dram" if linked else None)
        self.policy: EvictionPolicy[Any] = (
            WarmPins(policy, lambda: self.clock) if warm else policy)
        self.batched = batched
        self.items: dict[int, _Item] = {}
        self.victims: list[int] = []
        self.refused: set[int] = set()

    def allowed(self, item: _Item) -> bool:
        return item.kids == 0 and item.key not in self.refused

    def take(self, item: _Item) -> None:
        # what the store's drop does that the next choice sees: the parent may be a leaf
        self.victims.append(item.key)
        del self.items[item.key]
        if item.parent is not None:
            item.parent.kids -= 1

    def evict(self, count: int) -> int:
        if self.batched:
            return len(self.policy.pop_victims(self.allowed, count, self.take))
        taken = 0
        while taken < count and (victim := self.policy.pop_victim(self.allowed)) is not None:
            self.take(victim)
            taken += 1
        return taken

    def step(self, rng: random.Random, key: list[int]) -> None:
        self.clock += 1.0
        roll = rng.random()
        if roll < 0.45 or not self.items:  # a chain, maybe off a cached block
            parent = self.items.get(rng.choice(list(self.items))) if self.items and \
                rng.random() < 0.5 else None
            chain = []
            for _ in range(rng.randint(1, 12)):
                key[0] += 1
                item = _Item(key[0], parent)
                if parent is not None:
                    parent.kids += 1
                self.items[item.key] = item
                chain.append(item)
                parent = item
            self.policy.insert_many(reversed(chain))
        elif roll < 0.7:
            keys = rng.sample(sorted(self.items), min(6, len(self.items)))
            self.policy.access_many(self.items[k] for k in keys)
        elif roll < 0.78:
            item = self.items[rng.choice(sorted(self.items))]
            self.policy.pin(item)
            self.refused.add(item.key)
        elif roll < 0.84 and self.refused:
            key_ = rng.choice(sorted(self.refused))
            self.refused.discard(key_)
            if key_ in self.items:
                self.policy.unpin(self.items[key_])
        elif roll < 0.9 and isinstance(self.policy, WarmPins):
            item = self.items[rng.choice(sorted(self.items))]
            if item.key not in self.refused:
                self.policy.pin_soft(item, self.clock + rng.choice((0.5, 3.0, 20.0)))
        else:
            self.evict(rng.randint(1, 40))


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victims_in_one_call_are_those_one_by_one(name: str, linked: bool,
                                                   warm: bool) -> None:
    lives = [_Life(name, linked, warm, batched) for batched in (False, True)]
    for life in lives:
        rng, key = random.Random(f"{name}{linked}{warm}"), [0]
        for _ in range(400):
            life.step(rng, key)
    one_by_one, batched = lives
    assert len(one_by_one.victims) > 200  # (a life with evictions in it)
    assert batched.victims == one_by_one.victims
    names: Callable[[_Life], list[int]] = lambda life: [
        i.key for i in life.policy.evictable()]
    assert names(batched) == names(one_by_one)
    assert repr(batched.policy) == repr(one_by_one.policy)
    inner: Any = getattr(batched.policy, "inner", batched.policy)
    inner_one: Any = getattr(one_by_one.policy, "inner", one_by_one.policy)
    assert getattr(inner, "_tick", None) == getattr(inner_one, "_tick", None)


def test_a_call_stops_at_its_count_and_when_none_is_left() -> None:
    policy = make_policy("lru")
    policy.insert_many([1, 2, 3])
    taken: list[object] = []
    assert policy.pop_victims(lambda item: True, 2, taken.append) == [1, 2]
    assert policy.pop_victims(lambda item: True, 5, taken.append) == [3]
    assert taken == [1, 2, 3] and len(policy) == 0


@pytest.mark.parametrize("make", [LinkedOrder, linked_order])
def test_the_oldest_allowed_taken_one_after_another(make: Callable[[str], Any]) -> None:
    # ``LinkedOrder.take_oldest``, the reference and the compiled loop: each look starts
    # again at the oldest, and sees what ``take`` did (here: 3 allowed once 2 is gone)
    items = [_Item(k, None) for k in range(6)]
    order = make("dram")
    for item in items:
        order[item] = None
    gone: set[int] = set()
    refused = {0, 3}

    def allowed(item: _Item) -> bool:
        return item.key not in refused or (item.key == 3 and 2 in gone)

    taken = order.take_oldest(allowed, 4, lambda item: gone.add(item.key))
    assert [i.key for i in taken] == [1, 2, 3, 4]
    assert [i.key for i in order] == [0, 5] and len(order) == 2
    assert all(i.dram_order is None for i in taken)
    assert [i.key for i in order.take_oldest(allowed, 9, lambda item: None)] == [5]
    assert [i.key for i in order] == [0]


@pytest.mark.parametrize("make", [LinkedOrder, linked_order])
def test_a_take_that_changed_nothing_lets_the_walk_go_on(make: Callable[[str], Any]) -> None:
    # ``take`` returning ``GO_ON``: the next look goes on from the item taken, and the
    # refused items before it are looked at once, not once per victim; ``take`` that
    # takes the next item out of the order sends the look back to the oldest
    items = [_Item(k, None) for k in range(200)]
    order = make("dram")
    for item in items:
        order[item] = None
    looked = 0

    def allowed(item: _Item) -> bool:
        nonlocal looked
        looked += 1
        return item.key >= 100  # the 100 oldest are refused

    taken = order.take_oldest(allowed, 50, lambda item: GO_ON)
    assert [i.key for i in taken] == list(range(100, 150)) and looked == 150
    looked = 0
    taken = order.take_oldest(allowed, 2, lambda item: (order.pop(items[item.key + 1]), GO_ON)[1])
    assert [i.key for i in taken] == [150, 152] and looked == 101 + 101
    looked = 0
    assert [i.key for i in order.take_oldest(allowed, 2, lambda item: None)] == [154, 155]
    assert looked == 101 + 101 and len(order) == 100 + 44
