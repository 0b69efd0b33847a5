"""The daemon's heap settling: young garbage is collected, survivors are frozen."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from kvstore.heap import FULL_COLLECTIONS_OFF, settle, settle_every


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
