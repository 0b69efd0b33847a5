"""Victims read each queue's oldest item first (``LinkedOrder.oldest``), walking on only
when it is refused: the same victim as the walk of the whole queue, in tables and in
links, whichever items ``allowed`` refuses."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.scheduler.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, SLRUPolicy
from kvstore.scheduler.linked import LinkedOrder, Queue, linked_order


class Item:
    __slots__ = ("name", "a_order", "a_older", "a_newer")

    def __init__(self, name: int) -> None:
        self.name = name
        self.a_order = self.a_older = self.a_newer = None

    def __repr__(self) -> str:
        return f"Item({self.name})"


@pytest.mark.parametrize("make", [LinkedOrder, linked_order])
def test_oldest_is_the_first_listed_and_none_when_empty(
        make: Callable[[str], LinkedOrder[Item]]) -> None:
    order = make("a")
    a, b = Item(0), Item(1)
    assert order.oldest() is None
    order[a] = None
    order[b] = None
    assert order.oldest() is a
    order.move_to_end(a)
    assert order.oldest() is b
    assert order.pop(b) is None and b.a_order is None and b.a_older is None
    del order[a]
    assert order.oldest() is None and len(order) == 0 and a.a_order is None


def _first(queue: Queue[Item], allowed: Callable[[Item], bool], most: int | None) -> Item | None:
    return next((item for item in islice(queue, most) if allowed(item)), None)


def walked(policy: EvictionPolicy[Item], allowed: Callable[[Item], bool]) -> Item | None:
    """The victim each order's own walk picked before it read the oldest first."""
    if isinstance(policy, LRUPolicy):
        return _first(policy._order, allowed, None)
    if isinstance(policy, ARCPolicy):
        t1_first = len(policy._t1) > policy._target_t1 or not policy._t2
        lists = (policy._t1, policy._t2) if t1_first else (policy._t2, policy._t1)
        return next((v for q in lists if (v := _first(q, allowed, None)) is not None), None)
    assert isinstance(policy, SLRUPolicy)
    if len(policy._probation) > policy._target or not policy._protected:
        first, second = policy._probation, policy._protected
    else:
        first, second = policy._protected, policy._probation
    for queue, most in ((first, policy.skip), (second, None), (first, None)):
        victim = _first(queue, allowed, most)
        if victim is not None:
            return victim
    return None


steps = st.lists(st.tuples(st.sampled_from(["insert", "access", "pop", "pin", "unpin"]),
                           st.integers(0, 11), st.integers(0, 2 ** 12 - 1)), max_size=120)


@pytest.mark.parametrize("links", [None, "a"])
@pytest.mark.parametrize("make", [LRUPolicy, SLRUPolicy, ARCPolicy])
@settings(max_examples=200, deadline=None)
@given(history=steps)
def test_the_victim_is_the_one_the_walk_finds(
        make: type[EvictionPolicy[Item]], links: str | None,
        history: list[tuple[str, int, int]]) -> None:
    items = [Item(i) for i in range(12)]
    policy = make()
    policy.ghost_key = lambda item: item.name  # type: ignore[assignment,method-assign]
    if links is not None:
        policy.links = links  # type: ignore[attr-defined]
    if isinstance(policy, SLRUPolicy):
        policy.skip = 2  # refusals past the first pass, often
    for verb, index, mask in history:
        if verb != "pop":
            getattr(policy, verb)(items[index])
            continue
        def allowed(item: Item) -> bool:
            return bool(mask >> item.name & 1)
        expected = walked(policy, allowed)
        assert policy.pop_victim(allowed) is expected
