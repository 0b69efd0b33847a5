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


def _start(blocks: list[_Block], pinned: list[_Block] = []) -> tuple[
        Handover[Any], HitDensityPolicy[Any]]:
    old: LRUPolicy[Any] = LRUPolicy()
    # the head the warmest: a linked order lists a chain's children first
    old.insert_many(reversed([b for b in blocks if b not in pinned]))
    new: HitDensityPolicy[Any] = HitDensityPolicy()
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
