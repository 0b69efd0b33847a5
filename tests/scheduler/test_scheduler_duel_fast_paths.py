"""The duel's cheap paths answer as the general ones: a sampled key every miniature
holds is hit in each without its parent being asked for, and the ghost lists' map
(``FifoMap``, which reads its shards itself) answers as an ``OrderedDict`` across its
split into shards."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvstore.scheduler import sharded
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.eviction import LRUPolicy, SLRUPolicy
from kvstore.scheduler.sharded import FifoMap


def test_a_key_every_miniature_holds_is_hit_in_each_without_its_parent() -> None:
    asked: list[int] = []

    def parent_of(item: int) -> int | None:
        asked.append(item)
        return item - 1 if item > 1 else None

    duel: Duel[int] = Duel([LRUPolicy, SLRUPolicy], parent_of=parent_of, sample_shift=0)
    for item in range(1, 11):  # every key sampled, none evicted: both miniatures hold all
        duel.insert(item)
    assert asked == list(range(1, 11))  # a new key: each miniature links it to its parent
    before = duel.scores()
    duel.access(5)
    duel.access_many([7, 3])
    assert asked == list(range(1, 11))
    assert {name: duel.scores()[name] - score for name, score in before.items()} == {
        "lru": 3, "slru": 3}
    duel.access(7)  # the same hit again in the same tick: counted once
    assert duel.scores()["lru"] - before["lru"] == 3


def test_a_fifo_map_answers_as_an_ordered_dict_across_its_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded, "SPLIT_AT", 8)
    mine: FifoMap[int, int] = FifoMap()
    model: OrderedDict[int, int] = OrderedDict()
    for key in range(40):
        mine[key] = model[key] = key
        if key % 3 == 0:
            mine[key // 2] = model[key // 2] = -key  # set while held: its place kept
        if key % 5 == 0:
            assert mine.pop(key // 3, None) == model.pop(key // 3, None)
    assert mine.pop(1000, None) is None
    with pytest.raises(KeyError):
        mine.pop(1000)
    assert len(mine._map.shards) == sharded.SHARDS  # split
    assert len(mine) == len(model)
    while model:
        assert mine.popitem(last=False) == model.popitem(last=False)
    assert not mine
