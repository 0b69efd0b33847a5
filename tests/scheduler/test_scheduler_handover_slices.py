"""A duel's hand-over in slices (``kvstore.scheduler.handover``): left to finish before
any other call, it leaves the new order exactly as the one-call hand-over did (the same
victims from then on, ghosts and pins included), for each order ``auto`` duels and each
way round, over plain items and over items that keep the orders in their own links;
with calls between its slices, no item is lost, counted twice or evicted while pinned,
the victims are items the cache holds, and it ends; and no call passes more than its
share of items on."""

from __future__ import annotations

import random
from operator import attrgetter
from typing import Any

import pytest

from kvstore.scheduler import dueling, handover
from kvstore.scheduler.eviction import AutoPolicy
from kvstore.scheduler.handover import Handover

CANDIDATES = ("lru", "slru", "arc", "density")


class _Block:
    """A store block in miniature: a key, a parent, its links and its duel state."""

    __slots__ = ("key", "parent", "dram_duel", "dram_order", "dram_older", "dram_newer")

    def __init__(self, key: int, parent: _Block | None) -> None:
        self.key = key
        self.parent = parent
        self.dram_duel: bool | int | None = None
        self.dram_order = self.dram_older = self.dram_newer = None

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"_Block({self.key})"


class _Cache:
    """A cache of ``capacity`` items under one ``AutoPolicy``, driven by a random life
    of chains (new keys, hits, pins and unpins, drops), items plain ints or blocks."""

    def __init__(self, capacity: int, linked: bool) -> None:
        self.duel: AutoPolicy[Any] = AutoPolicy(sample_shift=1, epoch=24, shortest=4)
        self.linked = linked
        if linked:
            self.duel.ghost_key = attrgetter("key")
            self.duel.links = "dram"
        else:
            self.duel.parent_of = self._parents.get
        self.capacity = capacity
        self.items: dict[int, Any] = {}
        self.pins: dict[int, int] = {}
        self.victims: list[int] = []
        self.single = False  # each item its own call, as the replay's simulator makes them
        # with ``single``, inserts too (the store and the simulator both insert a
        # request's new blocks in one call; hit density links a parent inserted after
        # its child only within one)
        self.single_inserts = True

    _parents: dict[int, int | None] = {}

    def key(self, item: Any) -> int:
        return item.key if self.linked else item

    def _make(self, key: int, parent: int | None) -> Any:
        if not self.linked:
            self._parents[key] = parent
            return key
        return _Block(key, self.items.get(parent) if parent is not None else None)

    def allowed(self, item: Any) -> bool:
        return self.pins.get(self.key(item), 0) == 0

    def evict(self, room: int) -> None:
        while len(self.items) + room > self.capacity:
            victim = self.duel.pop_victim(self.allowed)
            if victim is None:
                return
            key = self.key(victim)
            assert key in self.items and self.pins.get(key, 0) == 0, key
            del self.items[key]
            self.victims.append(key)

    def put(self, keys: list[int]) -> None:
        fresh = [k for k in keys if k not in self.items]
        hits = [self.items[k] for k in keys if k in self.items]
        if hits and self.single:
            for item in hits:
                self.duel.access(item)
        elif hits:
            self.duel.access_many(hits)
        self.evict(len(fresh))
        made = []
        parent = None
        for k in keys:
            if k in self.items:
                parent = k
                continue
            item = self._make(k, parent)
            self.items[k] = item
            made.append(item)
            parent = k
        if made and self.single and self.single_inserts:
            for item in reversed(made):
                self.duel.insert(item)
        elif made:
            self.duel.insert_many(list(reversed(made)))

    def pin(self, key: int) -> None:
        if key in self.items:
            self.pins[key] = self.pins.get(key, 0) + 1
            if self.pins[key] == 1:
                self.duel.pin(self.items[key])

    def unpin(self, key: int) -> None:
        if self.pins.get(key, 0) > 0:
            self.pins[key] -= 1
            if self.pins[key] == 0:
                del self.pins[key]
                self.duel.unpin(self.items[key])

    def drop(self, key: int) -> None:
        if key in self.items and self.pins.get(key, 0) == 0:
            self.duel.remove(self.items.pop(key))


def _life(cache: _Cache, rng: random.Random, requests: int) -> None:
    """Requests for chains of a few conversations (their keys extend), some pinned
    for a while, some dropped."""
    for _ in range(requests):
        conv = rng.randrange(60)
        depth = rng.randrange(1, 12)
        keys = [conv * 1000 + d for d in range(depth)]
        cache.put(keys)
        roll = rng.random()
        if roll < 0.1:
            cache.pin(keys[-1])
        elif roll < 0.2 and cache.pins:
            cache.unpin(rng.choice(sorted(cache.pins)))
        elif roll < 0.23:
            cache.drop(keys[-1])


def _tiny_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of a couple of items (and names), so that calls come between the slices of
    every phase: the names read, the old order, the fresh items, the pinned ones, the
    ghosts."""
    monkeypatch.setattr(handover, "BURST", 1)
    monkeypatch.setattr(handover, "PASS_A_BURST", 2)
    monkeypatch.setattr(handover, "NAMES_A_STEP", 5)


def _quiet_life(cache: _Cache, rng: random.Random, requests: int = 300) -> None:
    """``requests`` of the cache's life with no hand-over, then the duel's hand-overs
    only where a test asks for them (no election, no reality check)."""
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
    _life(cache, rng, requests)
    cache.duel._take_over = take_over  # type: ignore[method-assign]
    cache.duel.margin = 1e9
    cache.duel.reality.z = None


def _finish(order: Handover[Any]) -> None:
    """Every step of a hand-over, with no other call between them."""
    steps = 0
    while not order.finished:
        order.step(10 ** 9)
        steps += 1
        assert steps < 100, order


def _ranking(cache: _Cache) -> list[int]:
    return [cache.key(i) for i in cache.duel._order.evictable()]


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize(("start", "to"), [(a, b) for a in CANDIDATES for b in CANDIDATES
                                           if a != b])
def test_slices_end_where_one_call_did(monkeypatch: pytest.MonkeyPatch, linked: bool,
                                       start: str, to: str) -> None:
    caches = []
    for at_once in (10 ** 9, 0):  # one call; slices
        monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", at_once)
        cache = _Cache(300, linked)
        take_over = cache.duel._take_over
        cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
        rng = random.Random(7)  # (elections hand over only when the test says)
        _life(cache, rng, 400)
        names = [m.order.name for m in cache.duel._minis]
        if cache.duel.leader != start:
            take_over(names.index(start))
            order = cache.duel._order
            if isinstance(order, Handover):
                _finish(order)
        _life(cache, rng, 100)
        order = cache.duel._order
        if isinstance(order, Handover):
            _finish(order)
        assert cache.duel.leader == start
        take_over(names.index(to))
        order = cache.duel._order
        assert isinstance(order, Handover) == (at_once == 0)
        if isinstance(order, Handover):
            assert not order.finished
            _finish(order)  # every slice before any other call
            assert order.finished and not isinstance(cache.duel._order, Handover)
        assert cache.duel.leader == to
        caches.append((cache, rng))
    (one, rng_one), (sliced, rng_sliced) = caches
    assert _ranking(one) == _ranking(sliced)
    assert len(one.duel) == len(sliced.duel)
    # the same life from then on: the same victims (ghosts, pins and tuning alike)
    before = (len(one.victims), len(sliced.victims))
    for cache, rng in caches:
        _life(cache, rng, 300)
    assert one.victims[before[0]:] == sliced.victims[before[1]:]
    assert len(one.victims) - before[0] > 100  # the comparison saw evictions


def _holds_each_once(cache: _Cache) -> None:
    order = cache.duel._order
    listed = [cache.key(i) for i in order.evictable()]
    assert len(listed) == len(set(listed)) == len(order)
    pinned = {k for k, n in cache.pins.items() if n > 0}
    assert set(listed) | pinned == set(cache.items)
    assert not set(listed) & pinned


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_calls_between_slices_lose_nothing(monkeypatch: pytest.MonkeyPatch, linked: bool,
                                           seed: int, tiny: bool) -> None:
    """Also with tiny steps, so that calls come between the slices of every phase (the
    names read, the old order, the fresh items, the pinned ones, the ghosts)."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    if tiny:
        _tiny_steps(monkeypatch)
    rng = random.Random(seed)
    cache = _Cache(400, linked)
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
    _life(cache, rng, 300)
    names = [m.order.name for m in cache.duel._minis]
    handed = 0
    for to in rng.sample(CANDIDATES, 3) * 3:
        if cache.duel.leader == to:
            continue
        take_over(names.index(to))
        order = cache.duel._order
        assert isinstance(order, Handover)
        calls = 0
        while isinstance(cache.duel._order, Handover):
            _life(cache, rng, 1)
            _holds_each_once(cache)
            calls += 1
            assert calls < (4000 if tiny else 400), order  # ahead of the traffic: it ends
        handed += 1
        assert cache.duel.leader == to
        _holds_each_once(cache)
    assert handed >= 4


def test_no_call_passes_more_than_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request naming n items passes on at most ``PASS_A_BURST`` per ``BURST`` of
    them (one burst more for those left from before): the loop's hold per call is
    bounded, whatever the cache's size; and the hand-over ends."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    cache = _Cache(5000, linked=True)
    rng = random.Random(3)
    for conv in range(500):  # 5000 blocks, about half of them hit once
        cache.put([conv * 1000 + d for d in range(10)])
        if rng.random() < 0.5:
            cache.put([conv * 1000 + d for d in range(5)])
    names = [m.order.name for m in cache.duel._minis]
    cache.duel._take_over(names.index("slru"))
    order = cache.duel._order
    assert isinstance(order, Handover)
    counts: list[tuple[int, int]] = []
    passed = order.passed
    while not order.finished:
        conv = rng.randrange(550)  # some new chains, some longer: misses too
        keys = [conv * 1000 + d for d in range(rng.randrange(1, 12))]
        cache.put(keys)  # its hits referenced, its new keys inserted: len(keys) items
        counts.append((len(keys), order.passed - passed))
        passed = order.passed
        assert len(counts) < 2000, order
    for named, moved in counts:
        assert moved <= handover.PASS_A_BURST * (named // handover.BURST + 1)
    assert sum(moved for _, moved in counts) >= 5000
    _holds_each_once(cache)


@pytest.mark.parametrize("to", ["slru", "density"])
@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("linked", [False, True])
def test_the_same_references_make_the_same_decisions_however_grouped(
        monkeypatch: pytest.MonkeyPatch, linked: bool, tiny: bool, to: str) -> None:
    """The store hits a chain in one call, the replay's simulator block by block: with
    a hand-over under way, the same references give the same victims either way (its
    steps come after the same items, not the same calls, and read the items' states as
    of the item they come after: a first hit earlier in the same call counts)."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    if tiny:  # slices within one lookup's hits: its earlier hits passed on within it
        monkeypatch.setattr(handover, "BURST", 2)
        monkeypatch.setattr(handover, "PASS_A_BURST", 3)
    runs = []
    for single in (False, True):
        cache = _Cache(400, linked)
        cache.single = single
        cache.single_inserts = to != "density"
        take_over = cache.duel._take_over
        cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
        rng = random.Random(11)
        _life(cache, rng, 300)
        take_over([m.order.name for m in cache.duel._minis].index(to))
        assert isinstance(cache.duel._order, Handover)
        while isinstance(cache.duel._order, Handover):
            _life(cache, rng, 1)
        _life(cache, rng, 100)
        runs.append((cache.victims, _ranking(cache)))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) > 500


def test_one_hand_over_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    cache = _Cache(300, linked=False)
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
    _life(cache, random.Random(1), 300)
    assert cache.duel.leader == "lru"
    names = [m.order.name for m in cache.duel._minis]
    take_over(names.index("arc"))
    first = cache.duel._order
    assert isinstance(first, Handover)
    switches = cache.duel.switches
    take_over(names.index("slru"))  # refused while one is under way
    assert cache.duel._order is first and cache.duel.switches == switches
    assert cache.duel.leader == "arc"
    _finish(first)
    take_over(names.index("slru"))  # and taken once it ended
    assert cache.duel.leader == "slru" and cache.duel.switches == switches + 1


def test_a_reality_check_refused_during_a_hand_over_is_not_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reality check hands back to LRU only once no hand-over is under way, and
    counts only a hand-back that happened."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    cache = _Cache(300, linked=False)
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: False  # type: ignore[method-assign]
    _life(cache, random.Random(2), 300)
    cache.duel._take_over = take_over  # type: ignore[method-assign]
    cache.duel.margin = 1e9  # no election hands over: only the reality check
    take_over(1)
    handing = cache.duel._order
    assert isinstance(handing, Handover) and cache.duel.leader == "slru"
    cache.duel.reality.behind = 1000  # the real cache far behind LRU's miniature
    cache.duel._elect()
    assert cache.duel.reality.checks == 0 and cache.duel._order is handing
    _finish(handing)
    cache.duel.reality.behind = 1000
    cache.duel._elect()
    assert cache.duel.reality.checks == 1 and cache.duel.leader == "lru"


def test_a_hand_over_let_go_while_it_recalls_its_ghosts_leaves_no_cycle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # released in its last phase (the victims' names recalled as ghosts a few a step,
    # many steps at a big cache): freed by reference counting alone, as the daemon's
    # collector never walks what it froze (a generator method's paused frame held it)
    import gc

    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)

    def alive() -> int:
        return sum(type(o) is Handover for o in gc.get_objects())

    gc.collect()
    before = alive()
    was = gc.isenabled()
    gc.disable()
    try:
        rng = random.Random(1)
        cache = _Cache(2000, False)
        take_over = cache.duel._take_over
        monkeypatch.setattr(cache.duel, "_take_over", lambda best: False)  # no election
        for _ in range(30_000):
            cache.put([rng.randrange(20_000)])
        take_over(CANDIDATES.index("slru"))
        order = cache.duel._order
        assert isinstance(order, Handover)
        while order._recall is None:
            cache.put([rng.randrange(20_000)])
        for _ in range(20):
            cache.put([rng.randrange(20_000)])
        assert not order.finished, "the recall ended: the test tests nothing"
        del order
        cache.duel.release()
        del cache, take_over
        assert alive() == before
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("linked", [False, True])
def test_the_victims_while_a_hand_over_reads_the_names_join_them_after(
        monkeypatch: pytest.MonkeyPatch, linked: bool) -> None:
    # the names are read where they lie, a few a step: the victims meanwhile are kept
    # aside and join them once read, so the duel's names are always its latest victims
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    monkeypatch.setattr(handover, "NAMES_A_STEP", 4)
    monkeypatch.setattr(handover, "BURST", 1)
    rng = random.Random(5)
    cache = _Cache(150, linked)
    take_over = cache.duel._take_over
    monkeypatch.setattr(cache.duel, "_take_over", lambda best: False)  # no election
    _life(cache, rng, 400)
    for to in ("slru", "density", "arc", "lru"):
        if cache.duel.leader == to:
            continue
        take_over(CANDIDATES.index(to))
        order = cache.duel._order
        assert isinstance(order, Handover) and cache.duel._aside is not None
        reading = before = len(cache.victims)
        while isinstance(cache.duel._order, Handover):
            _life(cache, rng, 1)
            if cache.duel._aside is not None:
                reading = len(cache.victims)
        assert cache.duel._aside is None
        assert reading > before, "no victim while the names were read: nothing tested"
        gone = list(cache.duel._gone)
        assert gone == cache.victims[-len(gone):]
