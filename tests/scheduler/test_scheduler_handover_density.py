"""A hand-over in slices to and from hit density: a chain's children passed on before
their parent are counted as its children once it comes (a parent of a tracked item is
no candidate), with calls between the slices as without; the hand-over ends and loses
nothing; no call passes more than its share; and the class lists are emptied oldest
stamp first, as the order lists them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore.scheduler import dueling, handover
from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.handover import Handover

from test_scheduler_handover_slices import (_Cache, _finish, _holds_each_once, _life,
                                            _quiet_life, _tiny_steps)


def _links_hold(order: HitDensityPolicy[Any], cache: _Cache, complete: bool) -> None:
    """Each entry's ``kids`` is the number of entries linked to it, each link names the
    item's parent; ``complete``: every item whose parent is tracked is linked to it.
    (A parent the test's cache drops leaves its children linked to its old entry, as
    without a hand-over: the store drops a subtree, never a parent alone.)"""
    entries = order._entries
    kids: dict[int, int] = {}
    for item, entry in entries.items():
        if entry.up is not None:
            assert cache.key(entry.parent) == cache.key(order.parent_of(item)), item
            kids[id(entry.up)] = kids.get(id(entry.up), 0) + 1
        elif complete:
            parent = order.parent_of(item)
            assert parent is None or parent not in entries, (item, parent)
    for item, entry in entries.items():
        assert entry.kids == kids.get(id(entry), 0), item


def _hand_over(cache: _Cache, to: str) -> Handover[Any]:
    names = [m.order.name for m in cache.duel._minis]
    cache.duel._take_over(names.index(to))
    order = cache.duel._order
    assert isinstance(order, Handover)
    return order


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("start", ["lru", "slru", "arc"])
def test_children_passed_before_their_parent_are_counted(
        monkeypatch: pytest.MonkeyPatch, linked: bool, start: str) -> None:
    """A linked order lists a chain's children before its parent (they are inserted
    deepest first): every one of them is the parent's child in hit density at the end,
    also where the slices are two items long."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    monkeypatch.setattr(handover, "PASS_A_BURST", 2)
    cache = _Cache(400, linked)
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
    _life(cache, random.Random(5), 300)
    cache.duel._take_over = take_over  # type: ignore[method-assign]
    if cache.duel.leader != start:
        _finish(_hand_over(cache, start))
    order = _hand_over(cache, "density")
    steps = 0
    while not order.finished:
        order.step(2)
        steps += 1
    assert steps > 100  # many slices, each a couple of items
    new = cache.duel._order
    assert isinstance(new, HitDensityPolicy)
    _links_hold(new, cache, complete=True)
    assert sum(e.kids for e in new._entries.values()) > 100  # chains were linked
    _holds_each_once(cache)


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_calls_between_density_slices_lose_nothing(monkeypatch: pytest.MonkeyPatch,
                                                   linked: bool, seed: int) -> None:
    """To and from hit density, tiny steps with the traffic between them: every item
    held once, the links consistent, each hand-over ends."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    _tiny_steps(monkeypatch)
    rng = random.Random(seed)
    cache = _Cache(400, linked)
    _quiet_life(cache, rng)  # then only the hand-overs the test asks for
    for to in ("density", "slru", "density", "lru", "density", "arc"):
        order = _hand_over(cache, to)
        calls = 0
        while isinstance(cache.duel._order, Handover):
            _life(cache, rng, 1)
            _holds_each_once(cache)
            calls += 1
            assert calls < 4000, order
        assert cache.duel.leader == to
        if to == "density":
            assert isinstance(cache.duel._order, HitDensityPolicy)
            _links_hold(cache.duel._order, cache, complete=False)
        _holds_each_once(cache)
        _life(cache, rng, 20)


@pytest.mark.parametrize("to", ["density", "lru"])
def test_no_density_call_passes_more_than_its_share(monkeypatch: pytest.MonkeyPatch,
                                                    to: str) -> None:
    """To hit density and from it: a request naming n items passes on at most
    ``PASS_A_BURST`` per ``BURST`` of them (one burst more for those left from before)."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    cache = _Cache(5000, linked=True)
    rng = random.Random(3)
    for conv in range(500):
        cache.put([conv * 1000 + d for d in range(10)])
        if rng.random() < 0.5:
            cache.put([conv * 1000 + d for d in range(5)])
    cache.duel.margin = 1e9
    cache.duel.reality.z = None
    if to == "lru":  # from hit density: put it in charge first
        _finish(_hand_over(cache, "density"))
    order = _hand_over(cache, to)
    counts: list[tuple[int, int]] = []
    passed = order.passed
    while not order.finished:
        conv = rng.randrange(550)
        keys = [conv * 1000 + d for d in range(rng.randrange(1, 12))]
        cache.put(keys)
        counts.append((len(keys), order.passed - passed))
        passed = order.passed
        assert len(counts) < 2000, order
    for named, moved in counts:
        assert moved <= handover.PASS_A_BURST * (named // handover.BURST + 1)
    assert sum(moved for _, moved in counts) >= 5000
    _holds_each_once(cache)


def test_density_lists_oldest_stamp_first_and_slices_follow() -> None:
    """``evictable`` merges the class lists by stamp (an item unpinned goes last in its
    list with its old stamp, and is listed from there); ``coldest``, taken and removed
    one by one, lists the same."""
    order: HitDensityPolicy[int] = HitDensityPolicy()
    order.insert_many(range(20))
    order.access_many([3, 7, 11])
    order.pin(1)
    order.access_many([15])
    order.unpin(1)
    listed = list(order.evictable())
    stamps = [order._entries[i].stamp for i in listed]
    assert sorted(listed) == list(range(20))
    assert listed.index(1) > listed.index(2)  # unpinned: after its class's later items
    assert stamps[:listed.index(1)] == sorted(stamps[:listed.index(1)])
    taken = []
    while (item := order.coldest()) is not None:
        order.remove(item)
        taken.append(item)
    assert taken == listed


def test_density_decides_the_same_however_its_hits_are_grouped() -> None:
    """A refresh falls at the same hit whether the hits come one by one (the replay's
    simulator) or a lookup's in one call (the store): the same victims."""
    runs = []
    for grouped in (False, True):
        order: HitDensityPolicy[int] = HitDensityPolicy(refresh=50)
        rng = random.Random(4)
        victims = []
        cached: set[int] = set()
        for _ in range(3000):
            conv = rng.randrange(80)
            keys = [conv * 100 + d for d in range(rng.randrange(1, 9))]
            hits = [k for k in keys if k in cached]
            for _touch in range(2):  # lookup, then acquire
                if grouped:
                    order.access_many(hits)
                else:
                    for k in hits:
                        order.access(k)
            fresh = [k for k in keys if k not in cached]
            while len(cached) + len(fresh) > 200:
                victim = order.pop_victim(lambda item: True)
                assert victim is not None
                cached.discard(victim)
                victims.append(victim)
            order.insert_many(fresh)
            cached.update(fresh)
        runs.append((victims, order.refreshes))
    assert runs[0] == runs[1]
    assert runs[0][1] > 20 and len(runs[0][0]) > 1000  # refreshes fell within lookups
