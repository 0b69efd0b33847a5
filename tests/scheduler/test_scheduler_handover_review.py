"""A duel's hand-over in slices (``kvstore.scheduler.handover``), checked further: every
phase counts its traffic the same whether a hit is reported once or twice a tick."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore.scheduler import dueling, handover
from kvstore.scheduler.handover import Handover

from test_scheduler_handover_slices import _Block, _Cache, _life, _ranking


def _paced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hand-over in slices, at a pace of its own (whatever the tuning)."""
    monkeypatch.setattr(dueling, "HANDOVER_AT_ONCE", 0)
    monkeypatch.setattr(handover, "BURST", 32)
    monkeypatch.setattr(handover, "PASS_A_BURST", 64)


class _Reporter(_Cache):
    """Each hit reported twice in its tick (the store's lookup, then its acquire)."""

    def put(self, keys: list[int]) -> None:
        hits = [self.items[k] for k in keys if k in self.items]
        if hits:
            self.duel.access_many(hits)
        super().put(keys)


@pytest.mark.parametrize("linked", [False, True])
def test_hits_reported_twice_step_as_once_in_every_phase(
        monkeypatch: pytest.MonkeyPatch, linked: bool) -> None:
    """Past the items (the pinned ones passed on, the ghosts recalled) the steps come
    after the same items too, or the daemon's hand-over ends at another reference
    than its simulator's."""
    _paced(monkeypatch)
    monkeypatch.setattr(handover, "NAMES_A_STEP", 96)  # a long recall (12 a step)
    runs = []
    for make in (_Cache, _Reporter):
        cache = make(400, linked)
        take_over = cache.duel._take_over
        cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
        rng = random.Random(5)
        _life(cache, rng, 300)
        take_over(1)
        order = cache.duel._order
        assert isinstance(order, Handover)
        ended = []
        for call in range(600):
            _life(cache, rng, 1)
            if order.finished and not ended:
                ended.append(call)
        runs.append((ended, cache.victims, _ranking(cache)))
    assert runs[0][0]  # it ended
    assert runs[0] == runs[1]


@pytest.mark.parametrize("linked", [False, True])
def test_a_hit_repeated_in_one_call_counts_once(monkeypatch: pytest.MonkeyPatch,
                                                linked: bool) -> None:
    """A call that names an item twice (an acquire of a key given twice) counts and
    places it as the simulator's calls one item at a time do: once, where first hit."""
    _paced(monkeypatch)
    states = []
    for single in (False, True):
        cache = _Cache(400, linked)
        take_over = cache.duel._take_over
        cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
        _life(cache, random.Random(5), 300)
        take_over(1)
        order = cache.duel._order
        assert isinstance(order, Handover)
        cache.put([-1])  # a new tick
        a, b = (cache.items[k] for k in sorted(cache.items)[:2])
        if single:
            for item in (a, b, a):
                cache.duel.access(item)
        else:
            cache.duel.access_many([a, b, a])
        states.append((order._count, [cache.key(i) for i in order.evictable()]))
    assert states[0] == states[1]


class _Watched(_Block):
    __slots__ = ("__weakref__",)


class _WatchedCache(_Cache):
    """Blocks that can be watched go away."""

    def _make(self, key: int, parent: int | None) -> Any:
        return _Watched(key, self.items.get(parent) if parent is not None else None)


@pytest.mark.parametrize("calls", [0, 40, 120])
def test_released_mid_way_it_keeps_nothing_alive(monkeypatch: pytest.MonkeyPatch,
                                                 calls: int) -> None:
    """Let go of (a policy switch, the store's end) part-way through a hand-over, the
    duel leaves every item unlinked and untracked, and nothing it held is kept alive
    by a cycle: reference counting alone frees the items and the orders."""
    import gc
    import weakref

    _paced(monkeypatch)
    monkeypatch.setattr(handover, "NAMES_A_STEP", 12)
    cache = _WatchedCache(400, linked=True)
    take_over = cache.duel._take_over
    cache.duel._take_over = lambda best: None  # type: ignore[method-assign]
    rng = random.Random(9)
    _life(cache, rng, 300)
    take_over(1)
    order = cache.duel._order
    assert isinstance(order, Handover)
    for _ in range(calls):
        _life(cache, rng, 1)
    assert not order.finished
    watched = [weakref.ref(order), weakref.ref(cache.duel)]
    watched += [weakref.ref(item) for item in cache.items.values()]
    gc.collect()
    gc.disable()
    try:
        cache.duel.release()
        for item in cache.items.values():
            assert item.dram_order is None and item.dram_duel is None, item
            assert item.dram_older is None and item.dram_newer is None, item
        del order, cache, take_over, item
        alive = [ref() for ref in watched if ref() is not None]
        assert not alive, alive[:3]
    finally:
        gc.enable()
