"""The daemon's heap settling: young garbage is collected, survivors are frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvstore.heap import settle


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


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
