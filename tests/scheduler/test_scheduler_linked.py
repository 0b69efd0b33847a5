"""An LRU order kept in its items' own links (``LinkedOrder``) against the same order
in a table: every history gives the same victims and the same listing, also when the
items sit in two orders at once (one per set of links) or pass from one order to
another with the same links (a policy switch)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.eviction import (
    ARCPolicy,
    AutoPolicy,
    EvictionPolicy,
    LRUPolicy,
    SLRUPolicy,
    WarmPins,
    make_policy,
)
from kvstore.scheduler.linked import LinkedOrder, linked_order


class Item:
    """An item with two sets of links, as the store's blocks have."""

    __slots__ = ("name", "a_order", "a_older", "a_newer", "b_order", "b_older", "b_newer")

    def __init__(self, name: int) -> None:
        self.name = name
        self.a_order = self.a_older = self.a_newer = None
        self.b_order = self.b_older = self.b_newer = None

    def __repr__(self) -> str:
        return f"Item({self.name})"


ITEMS = [Item(i) for i in range(10)]

events = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert_many", "access", "access_many", "pin", "unpin",
                         "remove", "pop", "switch"]),
        st.integers(0, len(ITEMS) - 1),
        st.integers(0, 2 ** len(ITEMS) - 1),
    ),
    max_size=150,
)


def apply(policy: EvictionPolicy[Item], verb: str, item: Item, mask: int) -> object:
    if verb == "pop":
        return policy.pop_victim(lambda i: bool(mask >> i.name & 1))
    if verb in ("insert_many", "access_many"):  # a run, one item twice, some not held
        run = [ITEMS[(item.name + step) % len(ITEMS)] for step in (0, 3, 0, 5)]
        getattr(policy, verb)(run)
        return None
    getattr(policy, verb)(item)
    return None


def linked_lru(specialised: bool) -> LRUPolicy[Item]:
    """An LRU order on links "a": the compiled one the policies use, or the reference."""
    policy: LRUPolicy[Item] = LRUPolicy()
    policy.links = "a"
    if not specialised:
        policy._order = LinkedOrder("a")
    assert (type(policy._order) is LinkedOrder) is not specialised
    return policy


@pytest.mark.parametrize("specialised", [True, False])
@settings(max_examples=300, deadline=None)
@given(history=events)
def test_linked_lru_evicts_as_the_table_does(
        specialised: bool, history: list[tuple[str, int, int]]) -> None:
    for item in ITEMS:
        item.a_order = item.b_order = None
    table: LRUPolicy[Item] = LRUPolicy()
    linked = linked_lru(specialised)
    other: LRUPolicy[Item] = LRUPolicy()  # the same items in a second order, links "b"
    other.links = "b"
    for verb, index, mask in history:
        item = ITEMS[index]
        if verb == "switch":  # a fresh order on the same links takes the items over,
            # the old one released first, as the store does
            listed, pinned = list(linked.evictable()), list(linked._pinned)
            linked.release()
            fresh = linked_lru(specialised)
            for kept in listed:
                fresh.insert(kept)
            for kept in pinned:
                fresh.insert(kept)
                fresh.pin(kept)
            linked = fresh
            rebuilt: LRUPolicy[Item] = LRUPolicy()
            for kept in table.evictable():
                rebuilt.insert(kept)
            for kept in table._pinned:
                rebuilt.insert(kept)
                rebuilt.pin(kept)
            table = rebuilt
            continue
        assert apply(linked, verb, item, mask) == apply(table, verb, item, mask)
        apply(other, "remove" if verb == "pop" else verb, item, mask)
        assert list(linked.evictable()) == list(table.evictable())
        assert list(linked.coldest()) == list(table.coldest())
        assert len(linked) == len(table)
    assert all(i.a_order is None or i.a_order is linked._order
               for i in ITEMS)


@pytest.mark.parametrize("make", [SLRUPolicy, ARCPolicy, HitDensityPolicy])
@settings(max_examples=300, deadline=None)
@given(history=events)
def test_segmented_orders_in_links_evict_as_in_tables(
        make: type[EvictionPolicy[Item]], history: list[tuple[str, int, int]]) -> None:
    """SLRU's two segments, ARC's two lists and hit density's class queues, all on one
    set of links (an item sits in one at a time), against the same order in tables:
    the miniatures' case."""
    for item in ITEMS:
        item.a_order = item.a_older = item.a_newer = None
    table, linked = make(), make()
    linked.links = "a"  # type: ignore[attr-defined]
    for policy in (table, linked):  # ghosts by name: both remember the same keys
        policy.ghost_key = lambda item: item.name  # type: ignore[assignment,attr-defined]
    for verb, index, mask in history:
        if verb == "switch":
            continue
        item = ITEMS[index]
        assert apply(linked, verb, item, mask) == apply(table, verb, item, mask)
        assert list(linked.evictable()) == list(table.evictable())
        assert repr(linked) == repr(table) and len(linked) == len(table)
    linked.insert(ITEMS[0])
    with pytest.raises(ValueError):  # links are chosen while the order is empty
        linked.links = None  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [LinkedOrder, linked_order])
def test_linked_order_behaves_as_an_ordered_dict(make: Callable[[str], LinkedOrder[Item]]) -> None:
    order = make("a")
    a, b, c = Item(0), Item(1), Item(2)
    for item in (a, b, c, a):
        order[item] = None
    assert list(order) == [a, b, c] and len(order) == 3 and b in order
    order.move_to_end(a)
    assert list(order) == [b, c, a]
    assert order.pop(c) is None and order.pop(c, "gone") == "gone"
    with pytest.raises(KeyError):
        order.pop(c)
    with pytest.raises(KeyError):
        del order[c]
    with pytest.raises(KeyError):
        order.move_to_end(c)
    order.move_to_end(a)  # the newest already
    assert list(order) == [b, a]
    for item in order:  # the item just yielded may go
        del order[item]
    assert not order and list(order) == [] and c.a_order is None
    for item in (c, a, b):
        order[item] = None
    order.clear()  # every item's links unset
    assert not order and list(order) == [] and len(order) == 0
    assert all(i.a_order is None and i.a_older is None and i.a_newer is None for i in (a, b, c))
    order[b] = None
    assert list(order) == [b] and b.a_order is order


def test_links_are_chosen_while_the_order_is_empty() -> None:
    lru: LRUPolicy[Item] = LRUPolicy()
    lru.insert(ITEMS[0])
    with pytest.raises(ValueError):
        lru.links = "a"
    with pytest.raises(ValueError):
        LinkedOrder("not a name")


def test_auto_keeps_its_lru_order_in_the_links_and_its_miniatures_in_their_own() -> None:
    policy = make_policy("auto", links="a")
    assert isinstance(policy, AutoPolicy) and policy.links == "a"
    assert isinstance(policy._order, LRUPolicy) and policy._order.links == "a"
    # each miniature's order lives in its sampled keys' links, not in the items'
    assert [getattr(m.order, "links", None) for m in policy._minis] == ["m0", "m1", "m2", "m3"]
    for item in ITEMS:  # other tests' orders leave them linked
        item.a_order = item.b_order = None
    items: list[Hashable] = list(ITEMS)
    for item in items:
        policy.insert(item)
    assert ITEMS[0].a_order is policy._order._order
    assert policy.pop_victim(lambda i: True) is ITEMS[0]


def test_an_order_handed_over_or_replaced_lets_go_of_the_items_links() -> None:
    for item in ITEMS:
        item.a_order = item.a_older = item.a_newer = None
    policy = make_policy("auto", links="a")
    assert isinstance(policy, AutoPolicy)
    for item in ITEMS:
        policy.insert(item)
    policy.pin(ITEMS[3])
    lru = policy._order
    policy._take_over(1)  # to SLRU: the items pass from the LRU order's links to its own
    assert policy.leader == "slru" and isinstance(policy._order, SLRUPolicy)
    assert policy._order.links == "a"
    assert all(i.a_order is not lru._order for i in ITEMS)  # type: ignore[attr-defined]
    assert ITEMS[0].a_order is policy._order._probation and ITEMS[3].a_order is None
    policy._take_over(2)  # to ARC, the same
    assert isinstance(policy._order, ARCPolicy) and ITEMS[0].a_order is policy._order._t1
    policy._take_over(0)  # back to LRU: a fresh order links them again
    assert policy.leader == "lru" and ITEMS[0].a_order is policy._order._order
    assert list(policy.evictable()) == [i for i in ITEMS if i is not ITEMS[3]]
    warm = WarmPins(policy, clock=lambda: 0.0)
    warm.release()  # a policy switch drops the whole order
    assert all(i.a_order is None for i in ITEMS)


def test_an_item_held_by_another_order_on_the_same_links_is_refused() -> None:
    class Item:
        def __init__(self) -> None:
            self.x_order = self.x_older = self.x_newer = None

    for make in (LinkedOrder, linked_order):
        first, second = make("x"), make("x")
        a, b, c = Item(), Item(), Item()
        first[a] = None
        first.extend([b])
        with pytest.raises(ValueError, match="another order"):
            second[a] = None
        with pytest.raises(ValueError, match="another order"):
            second.extend([c, b])
        assert list(first) == [a, b] and list(second) == [c] and len(second) == 1


@pytest.mark.parametrize("make", [LinkedOrder, linked_order])
def test_a_released_order_is_freed_without_the_collector(
    make: Callable[[str], LinkedOrder[Item]],
) -> None:
    # a daemon's heap is frozen after start-up: a cycle left by a dropped order (its end
    # pointing at itself) would stay for good
    items = [Item(i) for i in range(3)]
    order = make("a")
    for item in items:
        order[item] = None
    order.clear()
    end = weakref.ref(order._end)
    was = gc.isenabled()
    gc.disable()
    try:
        del order
        assert end() is None
    finally:
        if was:
            gc.enable()
    assert all(i.a_order is None and i.a_older is None and i.a_newer is None for i in items)
