"""The duel's batched insert (``Duel.insert_many``) against the same calls made item by
item (``dueling._insert_each``): every victim, election and state the same, for the
store's items (byte keys, a little-endian hash: the numpy sample test) and for plain
ints (the generic one), through elections, hand-overs, map splits and evictions."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from functools import partial
from operator import attrgetter
from typing import Any

import pytest

from kvstore.scheduler import sharded
from kvstore.scheduler.dueling import _insert_each
from kvstore.scheduler.eviction import AutoPolicy


class _Item:
    """A store block in miniature: a key, a parent, one set of links."""

    __slots__ = ("key", "parent", "dram_order", "dram_older", "dram_newer")

    def __init__(self, key: bytes, parent: _Item | None) -> None:
        self.key = key
        self.parent = parent
        self.dram_order = self.dram_older = self.dram_newer = None

    def __repr__(self) -> str:
        return f"_Item({self.key.hex()})"


class _Salted(partial):  # type: ignore[type-arg]
    """A name hash shaped like the store's that is not it (its own call)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs) ^ 0x5A5A


LITTLE = partial(int.from_bytes, byteorder="little")  # the store's: the numpy test
# hashes the numpy test must not take for the store's (they sample other items)
OTHER_HASHES = {"big": partial(int.from_bytes, byteorder="big"),
                "signed": partial(int.from_bytes, byteorder="little", signed=True),
                "salted": _Salted(int.from_bytes, byteorder="little")}


def _duel(keyed: bool, name_hash: Callable[[Any], int] = LITTLE) -> AutoPolicy[Any]:
    duel: AutoPolicy[Any] = AutoPolicy(sample_shift=1, epoch=24, shortest=4)
    if keyed:
        duel.ghost_key = attrgetter("key")
        duel.name_hash = name_hash
        duel.links = "dram"
    return duel


def _run(keyed: bool, batched: bool, seed: int,
         name_hash: Callable[[Any], int] = LITTLE) -> list[Any]:
    """A random life of a cache of 300 items: chains committed deepest first (some
    holding items tracked already, or one twice), hits, pins, evictions; every
    decision and the duel's state recorded."""
    rng = random.Random(seed)
    duel = _duel(keyed, name_hash)
    insert: Callable[[list[Any]], None] = (
        duel.insert_many if batched else partial(_insert_each, duel))  # type: ignore[assignment]
    made: list[Any] = []
    held: list[Any] = []
    parent_of: dict[Hashable, Hashable | None] = {}
    if not keyed:
        duel.parent_of = parent_of.get
    seen: list[Any] = []
    for step in range(400):
        size = rng.choice((1, 3, 17, 40, 90))
        if keyed:
            width = rng.choice((8, 16, 16, 24))  # the numpy test wants one length, 8k
            if rng.random() < 0.1:
                width = rng.choice((5, 12))
            chain: list[Any] = []
            parent = rng.choice(made) if made and rng.random() < 0.3 else None
            for _ in range(size):
                parent = _Item(rng.randbytes(width), parent)
                chain.append(parent)
        else:
            base = len(made) * 7 + 1
            chain = [base + i for i in range(size)]
            for i, item in enumerate(chain):
                parent_of[item] = chain[i - 1] if i else None
        made.extend(chain)
        while len(held) + len(chain) > 300:
            victim = duel.pop_victim(lambda _: True)
            seen.append(("victim", victim))
            if victim is None:
                break
            held.remove(victim)
        batch = list(reversed(chain))
        if held and rng.random() < 0.1:
            batch.insert(rng.randrange(len(batch) + 1), rng.choice(held))  # tracked
        if rng.random() < 0.05:
            batch.append(batch[0])  # one twice
        insert(batch)
        held.extend(chain)
        hits = rng.sample(held, min(len(held), rng.randrange(0, 30)))
        duel.access_many(hits)
        if hits and rng.random() < 0.2:
            duel.pin(hits[0])
            duel.unpin(hits[0])
        seen.append((step, duel.leader, duel.switches, duel._tick, duel._size,
                     len(duel._items), duel.scores()))
    seen.append(sorted((repr(k), v) for k, v in duel._items.items()))
    seen.append([repr(i) for i in duel.evictable()])
    return [repr(entry) for entry in seen]


@pytest.mark.parametrize("keyed", [True, False], ids=["keys", "ints"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batched_insert_decides_as_item_by_item(keyed: bool, seed: int) -> None:
    batched = _run(keyed, True, seed)
    assert batched == _run(keyed, False, seed)
    assert any("victim" in entry for entry in batched)
    switched = [entry for entry in batched if entry.startswith("(") and "'lru'" not in entry]
    assert switched, "the duel handed its order over at least once"


def test_batched_insert_across_a_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracked items' map splits inside a batch, at an election: the rest of the
    batch lands in the new shards."""
    monkeypatch.setattr(sharded, "SPLIT_AT", 50)
    for keyed in (True, False):
        assert _run(keyed, True, 7) == _run(keyed, False, 7)


@pytest.mark.parametrize("kind", sorted(OTHER_HASHES))
def test_other_name_hashes_are_not_taken_for_the_stores(kind: str) -> None:
    """A name hash of another byte order, signed, or a look-alike with its own call
    samples by what it returns, in a batch as item by item."""
    name_hash = OTHER_HASHES[kind]
    assert _run(True, True, 4, name_hash) == _run(True, False, 4, name_hash)
