"""The daemon's heap settling: young garbage is collected, survivors are frozen."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.heap import FULL_COLLECTIONS_OFF, QUIET_RUNS, settle, settle_every


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def thawed() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_settle_frees_young_cycles_and_freezes_survivors(thawed: None) -> None:
    dead, kept = Node(), Node()
    dead.other, kept.other = Node(), Node()
    dead.other.other, kept.other.other = dead, kept  # two cycles; one will be garbage
    gone = weakref.ref(dead)
    del dead
    before = gc.get_freeze_count()
    settle()
    assert gone() is None  # the young cycle was collected before the freeze
    assert gc.get_freeze_count() > before
    assert not gc.get_objects(generation=2)  # a full collection would walk nothing old
    assert kept.other is not None and kept.other.other is kept


def test_paused_keeps_the_collector_off_then_freezes_what_it_made(thawed: None) -> None:
    from kvstore.heap import paused

    assert gc.isenabled()
    before = gc.get_freeze_count()
    with paused():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)


def test_no_full_collection_between_settles(thawed: None) -> None:
    """Objects that survive the young generations between two settles never start a
    full collection (which would walk all of them: the loop's longest pause)."""
    full: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    def build() -> list[list[int]]:
        return [[i] for i in range(300_000)]  # survivors: containers the collector tracks

    gc.callbacks.append(count)
    try:
        gc.set_threshold(700, 10, 10)
        kept = build()  # the collector's own thresholds: full collections run
        assert full, "the default thresholds should have run a full collection"
        full.clear()
        settle()
        kept += build()
        assert not full
        settle()
        assert not gc.get_objects(generation=2)  # and the settle froze what they left
    finally:
        gc.callbacks.remove(count)


def test_a_quiet_settle_frees_old_cycles_and_stopping_gives_the_thresholds_back(
        thawed: None) -> None:
    loop = asyncio.new_event_loop()
    try:
        before = gc.get_threshold()
        dead = Node()
        dead.other = Node()
        dead.other.other = dead
        gone = weakref.ref(dead)
        gc.collect(1)  # the cycle, alive, passes on to the old generation
        del dead
        gc.collect(1)
        assert gone() is not None  # young collections do not reach it
        stop = settle_every(loop, seconds=3600.0)  # settles at once: a quiet spell, full
        assert gone() is None
        assert gc.get_threshold()[2] == FULL_COLLECTIONS_OFF
        stop()
        assert gc.get_threshold() == before
    finally:
        loop.close()


def test_the_first_quiet_settle_after_a_busy_spell_walks_no_old_generation(
        thawed: None) -> None:
    """The tail of a busy spell (what it made after the last settle) is frozen by the
    first quiet settle, not walked by a full collection (3.5-26 ms of the loop at 400k
    blocks); the quiet settle after that one is full again, and frees the old
    generation's dead cycles."""

    class Ticks:  # a loop that hands its timer's callback to the test
        def __init__(self) -> None:
            self.tick: Any = None

        def call_later(self, seconds: float, tick: Any) -> Any:
            self.tick = tick
            return SimpleNamespace(cancel=lambda: None)

    full: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    loop = Ticks()
    gc.callbacks.append(seen)
    try:
        stop = settle_every(loop, seconds=1.0)  # type: ignore[arg-type]
        assert full == [1]                      # the first settle: quiet, full
        for _ in range(QUIET_RUNS + 1):         # a busy spell: objects passed on
            gc.collect(1)
        loop.tick()                              # its settle: busy, not full
        loop.tick()                              # the first quiet one: frozen, not full
        assert full == [1]
        dead = Node()
        dead.other = Node()
        dead.other.other = dead
        gone = weakref.ref(dead)
        gc.collect(1)                            # alive, it passes on to the old generation
        del dead
        loop.tick()                              # quiet after quiet: full
        assert full == [1, 1] and gone() is None
        stop()
    finally:
        gc.callbacks.remove(seen)
