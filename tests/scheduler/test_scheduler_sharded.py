"""The split map the duel keeps its tracked items in: a dict's answers before and after
it splits, and keys made from object addresses spread over every shard."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.scheduler import sharded
from kvstore.scheduler.sharded import SHARDS, FifoMap, ShardedDict


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "pop", "del", "get"]),
                          st.integers(-50, 50), st.integers()), max_size=200))
def test_it_answers_as_a_dict_across_its_split(ops: list[tuple[str, int, int]]) -> None:
    split_at, sharded.SPLIT_AT = sharded.SPLIT_AT, 8  # split after a few keys
    try:
        check_against_a_dict(ops)
    finally:
        sharded.SPLIT_AT = split_at


def apply(mine: Any, model: dict[int, int], verb: str, key: int, value: int) -> None:
    """``verb`` (set, pop, del) done to both maps, their answers compared."""
    if verb == "set":
        mine[key] = value
        model[key] = value
    elif verb == "pop":
        assert mine.pop(key, None) == model.pop(key, None)
    elif verb == "del" and key in model:
        del mine[key]
        del model[key]


def check_against_a_dict(ops: list[tuple[str, int, int]]) -> None:
    mine: ShardedDict[int, int] = ShardedDict()
    model: dict[int, int] = {}
    grew = False  # past the split size once: split for good
    for verb, key, value in ops:
        apply(mine, model, verb, key, value)
        assert (key in mine) == (key in model) and mine.get(key) == model.get(key)
        assert len(mine) == len(model)
        grew = grew or len(model) > 8
    assert dict(mine.items()) == model and sorted(mine) == sorted(model)
    assert (mine.modulus == SHARDS) == grew
    with pytest.raises(KeyError):
        mine.pop(1000)


def test_keys_from_object_addresses_fill_every_shard() -> None:
    class Entry:  # the size of a block entry, whose hash the duel keys by
        __slots__ = tuple(f"s{i}" for i in range(21))

    entries = [Entry() for _ in range(60_000)]
    tracked: ShardedDict[int, Entry] = ShardedDict()
    for entry in entries:
        tracked[hash(entry)] = entry
    sizes = [len(shard) for shard in tracked.shards]
    assert len(sizes) == SHARDS and min(sizes) > 0
    assert max(sizes) < 2 * len(entries) / SHARDS


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "pop", "del", "oldest", "peek"]),
                          st.integers(0, 12), st.integers()), max_size=300))
def test_a_fifo_map_answers_as_an_ordered_dict(ops: list[tuple[str, int, int]]) -> None:
    """The ghost lists' map: keys taken from the middle and set again, a key set while
    held (it keeps its place), the oldest given up, as an ``OrderedDict`` does; its
    deque turning (to drop stale keys) after a few of them, so that turns run often."""
    slack, FifoMap.SLACK = FifoMap.SLACK, 2
    try:
        check_against_an_ordered_dict(ops)
    finally:
        FifoMap.SLACK = slack


def check_against_an_ordered_dict(ops: list[tuple[str, int, int]]) -> None:
    mine: FifoMap[int, int] = FifoMap()
    model: OrderedDict[int, int] = OrderedDict()
    for verb, key, value in ops:
        apply(mine, model, verb, key, value)
        if verb == "oldest":
            if model:
                assert mine.popitem(last=False) == model.popitem(last=False)
            else:
                with pytest.raises(KeyError):
                    mine.popitem(last=False)
        elif verb == "peek":  # the oldest, left in (hit density's ghosts' horizon)
            if model:
                assert mine.oldest() == next(iter(model.items()))
            else:
                with pytest.raises(KeyError):
                    mine.oldest()
        assert len(mine) == len(model) and bool(mine) == bool(model)
        assert (key in mine) == (key in model)
    while model:  # the rest, oldest first
        assert mine.popitem(last=False) == model.popitem(last=False)
    with pytest.raises(KeyError):
        mine.pop(0)


def test_a_fifo_map_whose_keys_are_taken_from_the_middle_stays_small() -> None:
    """Ghosts hit again leave by ``pop``, and the oldest may never be given up: the
    stale keys they leave behind are dropped as the map goes, not kept for ever."""
    ghosts: FifoMap[int, int] = FifoMap()
    for key in range(500):
        ghosts[key] = key  # old keys that stay
    most = 0
    for key in range(500, 300_000):
        ghosts[key] = key
        ghosts.pop(key)  # hit again: out of the middle, the oldest staying
        most = max(most, ghosts.held())
    assert len(ghosts) == 500
    assert most <= 3 * len(ghosts) + 2 * FifoMap.SLACK, most
    assert [ghosts.popitem(last=False)[0] for _ in range(500)] == list(range(500))


def test_a_fifo_map_gives_up_its_oldest_in_the_middle_of_a_turn() -> None:
    """The keys a turn has moved are the oldest: given up before those still to move
    (a turn that moved them behind the others gave up a younger key)."""
    slack, FifoMap.SLACK = FifoMap.SLACK, 2
    try:
        mine: FifoMap[int, int] = FifoMap()
        model: OrderedDict[int, int] = OrderedDict()
        for key in range(8):
            mine[key] = model[key] = key
        for key in range(1, 7):
            assert mine.pop(key) == model.pop(key)  # the last pop begins a turn
        assert mine.popitem(last=False) == model.popitem(last=False) == (0, 0)
        rng = random.Random(5)  # and many short histories, turning all the time
        for _ in range(3000):
            check_against_an_ordered_dict(
                [(rng.choice(["set", "set", "pop", "oldest", "peek"]), rng.randrange(12), 0)
                 for _ in range(60)])
    finally:
        FifoMap.SLACK = slack


def test_dismantled_a_step_at_a_time() -> None:
    """A split map and a ghost list emptied a few entries a step (an old order's tables
    let go during a hand-over), nothing left at the end."""
    table: ShardedDict[int, int] = ShardedDict()
    ghosts: FifoMap[int, int] = FifoMap()
    for key in range(100_000):
        table[key] = key
        ghosts[key] = key
    for key in range(0, 100_000, 3):
        ghosts.pop(key)  # stale keys in its deque too
    for box in (table, ghosts):
        before, steps = len(box), 0
        for _ in box.dismantle(1000):
            steps += 1
        assert len(box) == 0 and not box
        assert steps >= before // 1000
    assert not any(table.shards) and ghosts.held() == 0
