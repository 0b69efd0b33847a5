"""A duel's hand-over in slices reads the latest victims' names from the duel's own list
(no copy of them all when it begins: 256k names held the switch 4.3-6.5 ms at a million
blocks), a step at a time, and puts them back before the names of the victims since,
within the duel's bound: at the end the duel's list is what it would have been had the
hand-over copied it."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from kvstore.scheduler import handover
from kvstore.scheduler.eviction import LRUPolicy
from kvstore.scheduler.handover import Handover, parts_of


@pytest.mark.parametrize("bound", [64, 30, 12])
def test_the_names_read_go_back_before_the_later_victims(
        monkeypatch: pytest.MonkeyPatch, bound: int) -> None:
    monkeypatch.setattr(handover, "NAMES_A_STEP", 4)
    old: LRUPolicy[Any] = LRUPolicy()
    items = [f"item{i}" for i in range(20)]
    old.insert_many(items)
    names = deque((f"gone{i}" for i in range(25)), maxlen=bound)
    copied = deque(names, maxlen=bound)  # the duel's list had the hand-over copied it
    later: deque[str] = deque(maxlen=bound)  # the duel's own list from the switch on
    new: LRUPolicy[Any] = LRUPolicy()
    parts = parts_of(old)
    assert parts is not None
    done: list[Any] = []
    order = Handover(parts, new, [], lambda item: False, names, lambda item: item,
                     lambda: None, done.append, lambda: later)
    step = 0
    while not done:
        if step % 3 == 0:  # victims of the hand-over's own, their names kept after
            later.append(f"late{step}")
            copied.append(f"late{step}")
        order.step(2)
        step += 1
        assert step < 1000
    assert list(later) == list(copied)
    assert not names  # (read, emptied: nothing of it kept twice)
