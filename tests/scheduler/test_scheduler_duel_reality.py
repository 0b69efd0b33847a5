"""The duel's reality check: the miniatures are judged against each other, and the real
cache against the first candidate's (LRU's) miniature on the same sampled references; a
cache that lags it by more than chance goes back to LRU."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvstore.scheduler.dueling import Duel, Order
from kvstore.scheduler.eviction import LRUPolicy, SLRUPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_sim  # noqa: E402  (benchmarks/ is no package)


class _MostRecentFirst:
    """An order that gives up the item used last: on traffic where recency is the
    signal, far worse than LRU."""

    name = "mru"

    def __init__(self) -> None:
        self._items: dict[Hashable, None] = {}
        self._pinned: set[Hashable] = set()

    def insert(self, item: Hashable) -> None:
        self._items.pop(item, None)
        self._items[item] = None

    def insert_many(self, items: Iterable[Hashable]) -> None:
        for item in items:
            self.insert(item)

    def access(self, item: Hashable) -> None:
        if item in self._items:
            self.insert(item)

    def access_many(self, items: Iterable[Hashable]) -> None:
        for item in items:
            self.access(item)

    def pin(self, item: Hashable) -> None:
        self._pinned.add(item)

    def unpin(self, item: Hashable) -> None:
        self._pinned.discard(item)

    def remove(self, item: Hashable) -> None:
        self._items.pop(item, None)
        self._pinned.discard(item)

    def pop_victim(self, allowed: Callable[[Hashable], bool]) -> Hashable | None:
        for item in reversed(self._items):
            if item not in self._pinned and allowed(item):
                del self._items[item]
                return item
        return None

    def adopt_tuning(self, learned: Any, scale: float) -> None:
        pass

    def recall(self, names: Iterable[Hashable]) -> None:
        pass

    def evictable(self) -> Iterator[Hashable]:
        return (item for item in self._items if item not in self._pinned)

    def __len__(self) -> int:
        return len(self._items) - len(self._pinned)


def _two_faced() -> Callable[[], Order[Any]]:
    """A candidate whose miniature is an LRU (it ties LRU's: no election leaves LRU for
    it, or comes back) but whose order in charge gives up the most recent item: what
    only the real cache's hits reveal."""
    made: list[object] = []

    def make() -> Order[Any]:
        order: Order[Any] = LRUPolicy() if not made else _MostRecentFirst()
        made.append(order)
        return order
    return make


def _drift(seed: int, requests: int) -> list[replay_sim.TraceRequest]:
    """Single blocks from a window of 80 that slides on: recency is everything."""
    rng = random.Random(seed)
    return [replay_sim.TraceRequest(0, 512, 1, [i // 4 + rng.randrange(80)])
            for i in range(requests)]


def _replay(duel: Duel[Any], trace: list[replay_sim.TraceRequest]) -> int:
    cache = replay_sim.PolicyCache(duel, 60)  # type: ignore[arg-type]
    hits = 0
    for index, request in enumerate(trace):
        if index == 500:  # full, and evicting: the bad order takes over
            duel._take_over(1)
        found = cache.lookup(request.hash_ids)
        hits += found
        cache.insert(request.hash_ids, found)
    return hits


def test_a_cache_that_lags_lru_s_miniature_goes_back_to_lru() -> None:
    trace = _drift(seed=5, requests=12_000)
    checked = Duel([LRUPolicy, _two_faced()], sample_shift=1)
    unchecked = Duel([LRUPolicy, _two_faced()], sample_shift=1, check=None)
    lru = Duel([LRUPolicy], sample_shift=1)
    got, stuck = _replay(checked, trace), _replay(unchecked, trace)
    plain = replay_sim.replay(trace, replay_sim.PolicyCache(lru, 60)).hit_blocks  # type: ignore[arg-type]
    assert unchecked.leader == "mru" and unchecked.switches == 1, unchecked
    assert checked.leader == "lru" and checked.reality.checks == 1 and checked.switches == 2, checked
    assert stuck < 0.8 * plain, (stuck, plain)
    assert got > 0.95 * plain, (got, plain)


def _checked_duel() -> Duel[int]:
    """A duel of LRU and SLRU (every key sampled) that the reality check sent back to
    LRU: its SLRU lagged LRU's miniature on 20 sampled references, ahead on none."""
    duel = Duel([LRUPolicy, SLRUPolicy], sample_shift=0)
    duel.insert_many(range(10))
    assert duel.pop_victim(lambda _: True) == 0
    duel._take_over(1)
    duel.reality.behind = 20
    duel._elect()
    assert duel.leader == "lru" and duel.reality.checks == 1 and duel.switches == 2
    return duel


def test_a_lag_within_chance_keeps_the_order() -> None:
    duel = Duel([LRUPolicy, SLRUPolicy], sample_shift=0)
    duel.insert_many(range(10))
    duel.pop_victim(lambda _: True)
    duel._take_over(1)
    duel.reality.ahead, duel.reality.behind = 10, 18  # 8 behind: under 2 standard deviations of 28
    duel._elect()
    assert duel.leader == "slru" and duel.reality.checks == 0


def test_after_the_check_an_election_hands_over_as_before() -> None:
    duel = _checked_duel()
    duel._minis[1].hits = 1000
    duel._elect()
    assert duel.leader == "slru" and duel.switches == 3, duel
    assert duel.reality.ahead == duel.reality.behind == 0  # counted afresh for the new order
