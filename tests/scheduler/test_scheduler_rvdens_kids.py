"""A hand-over to hit density keeps a chain's head counted as a parent: a parent
referenced or pinned while the hand-over runs leaves the new order and comes back,
and its tracked children must still count as its children then (density's kids count
is what keeps a chain's head from going before its children)."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.scheduler import handover
from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.eviction import LRUPolicy
from kvstore.scheduler.handover import Handover, parts_of
from kvstore.scheduler.sharded import SPLIT_AT, ShardedDict


class _Block:
    """A chain's block: hashed by its name, with its parent."""

    def __init__(self, name: str, parent: _Block | None) -> None:
        self.name = name
        self.parent = parent

    def __repr__(self) -> str:
        return self.name


def _chain(tag: str, n: int) -> list[_Block]:
    blocks: list[_Block] = []
    for d in range(n):
        blocks.append(_Block(f"{tag}{d}", blocks[-1] if blocks else None))
    return blocks


def _start(blocks: list[_Block], pinned: list[_Block] = [], spread: bool = False
           ) -> tuple[Handover[Any], HitDensityPolicy[Any]]:
    old: LRUPolicy[Any] = LRUPolicy()
    # the head the warmest: a linked order lists a chain's children first
    old.insert_many(reversed([b for b in blocks if b not in pinned]))
    new: HitDensityPolicy[Any] = HitDensityPolicy()
    if spread:  # the store's: its entries sharded
        new.spread()
    parts = parts_of(old)
    assert parts is not None
    order = Handover(parts, new, pinned, lambda item: False, [], lambda item: item,
                     lambda: None, lambda new: None)
    return order, new


def _kids_hold(new: HitDensityPolicy[Any]) -> None:
    """Every tracked child is linked to its tracked parent's live entry, and each
    entry's ``kids`` counts them."""
    entries = new._entries
    kids: dict[int, int] = {}
    for item, entry in entries.items():
        parent = new.parent_of(item)
        if parent is not None and parent in entries:
            assert entry.up is entries[parent], (item, parent)
            kids[id(entry.up)] = kids.get(id(entry.up), 0) + 1
    for item, entry in entries.items():
        assert entry.kids == kids.get(id(entry), 0), item


def _finish(order: Handover[Any]) -> None:
    while not order.finished:
        order.step(handover.PASS_A_BURST)


@pytest.mark.parametrize("how", ["referenced", "pinned"])
def test_a_parent_out_and_back_keeps_its_children(how: str) -> None:
    """The chain's head passed on with its children, then hit (to ``fresh``) or
    pinned (to the pinned ones) while the hand-over runs: once back in the new order
    it is still its children's parent, and no victim while they are there."""
    a, b = _chain("a", 4), _chain("b", 4)
    order, new = _start(a + b)
    order.step(8)  # both chains passed on, every link made in the new order
    assert len(new) == 8
    _kids_hold(new)
    head = a[0]
    if how == "referenced":
        order.access_many([head])
    else:
        order.pin(head)
    _finish(order)
    if how == "pinned":
        order.unpin(head)
    _kids_hold(new)
    assert new._entries[head].kids == 1
    victims = [new.pop_victim(lambda item: True) for _ in range(8)]
    assert victims.index(head) > victims.index(a[1])  # not before its child


def test_the_store_s_order_sets_aside_in_shards_and_each_comes_back_a_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's order (its entries sharded) has the entries set aside in shards too:
    a hand-over to it at a million blocks set aside up to 95k, and one dict of them
    grew in single calls of 2.5 ms.  Each head hit while the hand-over runs comes back
    its child's parent."""
    monkeypatch.setattr(handover, "BURST", 1 << 20)  # no step within the hits
    chains = [_chain(f"c{i}.", 2) for i in range(SPLIT_AT + 100)]
    blocks = [block for chain in chains for block in chain]
    order, new = _start(blocks, spread=True)
    order.step(len(blocks))  # all passed on, the hand-over not over
    assert not order.finished
    order.access_many([chain[0] for chain in chains])  # every head out, to come back
    aside = new._aside
    assert isinstance(aside, ShardedDict) and len(aside.shards) > 1
    assert len(aside) == len(chains)
    _finish(order)
    _kids_hold(new)
    assert all(new._entries[chain[0]].kids == 1 for chain in chains)
    assert not new._aside


@pytest.mark.parametrize("how", ["referenced", "pinned"])
def test_a_parent_set_aside_and_gone_is_not_kept(how: str) -> None:
    """A parent out of the new order (hit, or pinned) that leaves the cache before it is
    passed on again: its entry is not held past its removal."""
    a = _chain("a", 3)
    order, new = _start(a)
    order.step(3)  # all passed on, the hand-over not over
    assert not order.finished
    head = a[0]
    if how == "referenced":
        order.access_many([head])
    else:
        order.pin(head)
    order.remove(head)
    assert not new._aside
    order.access_many([a[1]])
    _finish(order)
    _kids_hold(new)
    assert head not in new._entries
    assert not new._aside


def test_a_chain_inserted_as_the_hand_over_ends_is_linked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's blocks inserted in one call, deepest first, the hand-over ending at a
    step between two of its runs: the children in the run before are still their
    parents' children once those come, as in one call."""
    monkeypatch.setattr(handover, "BURST", 2)
    order, new = _start(_chain("a", 1))
    b = _chain("b", 4)
    order.insert_many(list(reversed(b)))
    assert order.finished  # at the step after the first run
    _kids_hold(new)
    assert [new._entries[x].kids for x in b] == [1, 1, 1, 0]


def test_a_chain_inserted_in_two_calls_is_linked_until_a_victim_or_hit() -> None:
    """A chain's blocks inserted in two calls, the deepest first (a duel splits an insert
    at its sampled keys): linked as in one call, unless a victim or a hit came between
    (another request's: its parent not tracked, the child stays a leaf)."""
    for between in ("", "hit", "victim"):
        new: HitDensityPolicy[Any] = HitDensityPolicy()
        other = _Block("x", None)
        new.insert_many([other])
        a = _chain("a", 3)
        new.insert_many([a[2], a[1]])
        if between == "hit":
            new.access_many([other])
        elif between == "victim":
            assert new.pop_victim(lambda item: item is other) is other
        new.insert_many([a[0]])
        if not between:
            _kids_hold(new)
        assert new._entries[a[0]].kids == (0 if between else 1), between
        assert not new._later or not between


@pytest.mark.parametrize("at_once", [0, 10 ** 9])
def test_density_in_charge_of_a_duel_links_every_chain(
        monkeypatch: pytest.MonkeyPatch, at_once: int) -> None:
    """Through a duel (its inserts split at sampled keys), to hit density in slices and
    under it after: every tracked item whose parent is tracked is linked to it (the
    test's cache drops no parent alone; its blocks, as the store's, are made anew once
    evicted: a child of an evicted parent names none tracked)."""
    import random

    from kvstore.scheduler import dueling
    from test_scheduler_handover_slices import _Cache, _life, _quiet_life, _tiny_steps

    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", at_once)  # in slices, or one call
    _tiny_steps(monkeypatch)
    for seed in range(4):
        rng = random.Random(seed)
        cache = _Cache(400, linked=True)
        _quiet_life(cache, rng)  # then only the hand-over the test asks for
        monkeypatch.setattr(cache, "drop", lambda key: None)
        names = [m.order.name for m in cache.duel._minis]
        cache.duel._take_over(names.index("density"))
        while isinstance(cache.duel._order, Handover):
            _life(cache, rng, 1)
        new = cache.duel._order
        assert isinstance(new, HitDensityPolicy)
        _kids_hold(new)
        _life(cache, rng, 100)
        _kids_hold(new)


def test_the_rest_of_a_call_after_a_hand_over_at_once_is_linked() -> None:
    """A hand-over in one call within an insert a duel split at a sampled key: the
    chain's deeper blocks in the old order, its parents inserted after into hit
    density, linked to them as in one call."""
    b = _chain("b", 4)
    old: LRUPolicy[Any] = LRUPolicy()
    old.insert_many([b[3], b[2]])
    new: HitDensityPolicy[Any] = HitDensityPolicy()
    handover.hand_over_at_once(old, new, [], lambda item: None, [], lambda item: item,
                               lambda order: order.release(), lambda: None)
    new.insert_many([b[1], b[0]])
    _kids_hold(new)
    assert [new._entries[x].kids for x in b] == [1, 1, 1, 0]


def test_every_class_head_refused_a_leaf_goes_before_a_parent() -> None:
    """Each class's oldest few refused by the store (pinned leaves, here): the victim
    is the first allowed leaf, not a parent of a tracked item (the store lets a parent
    with a copy on SSD go: hit density's own count keeps a chain's head); a parent
    only where no leaf is allowed."""
    new: HitDensityPolicy[Any] = HitDensityPolicy(skip=2)
    a = _chain("a", 3)  # a0 <- a1 <- a2
    first, last = _Block("z", None), _Block("y", None)
    new.insert_many([first])
    new.insert_many(list(reversed(a)))  # the deepest first, as the store's
    new.insert_many([last])  # one class, oldest first: z, a2, a1, a0, y
    held = {first, a[2]}
    assert new.pop_victim(lambda item: item not in held) is last
    assert new.pop_victim(lambda item: item not in held) in (a[0], a[1])
