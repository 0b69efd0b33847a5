"""A dict split into sub-dicts once it is big, so that no single insert rebuilds it all.

A Python dict grows by rebuilding its whole table when it passes two thirds full: in
the duel's map of every tracked item, at 5M blocks that is one insert holding the
event loop for 271 ms (``benchmarks/index_scale.py``).  ``ShardedDict`` starts as one
dict and, past ``SPLIT_AT`` entries, spreads them over ``SHARDS`` dicts by hash (one
pass, once: 0.4 ms at 4k entries; at 32k, 3.7 ms alone and 8-11 in a step of a change
of policy filling hit density's entries or a ghost table at a million blocks,
``benchmarks/eviction_cost.py --switch 1M``), so that each later rebuild is about a
``SHARDS``-th of the size.  No decision reads the shards' order (the store's eviction
digests, ``benchmarks/evict_decisions.py``, are the same at either split point).  The store's key map does the same for bytes keys (``kvstore.block_map``); this
one serves any hashable key and counts its entries, for the duel asks its size on
every insert.  The price is a Python call per operation instead of the dict's C one;
the hot loops index ``shards`` themselves (``shards[hash(key) % modulus]``): the duel's
to read, ``FifoMap`` (in this module) to read and write, counting in ``_len`` and
splitting as ``__setitem__`` does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from itertools import chain
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Prime: the duel's keys are hashes of objects, from their addresses, which the
# allocator spaces evenly: 100k block entries took 64 of 256 shards by a mask (each
# four times the size, and one 0.7 s insert at 7.4M blocks), all 251 by this modulus
SHARDS = 251
SPLIT_AT = 1 << 12

_MISSING: Any = object()
_ABSENT: Any = object()  # not held (``_MISSING`` as a default means none was given)


class ShardedDict(Generic[K, V]):
    """A dict's basic operations over ``SHARDS`` sub-dicts (iteration: shard by shard)."""

    __slots__ = ("shards", "modulus", "_len")

    def __init__(self) -> None:
        self.shards: list[dict[K, V]] = [{}]
        self.modulus = 1  # a key's shard: ``hash(key) % modulus``
        self._len = 0

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) % self.modulus]

    def __getitem__(self, key: K) -> V:
        return self.shards[hash(key) % self.modulus][key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self.shards[hash(key) % self.modulus].get(key, default)

    def __setitem__(self, key: K, value: V) -> None:
        shard = self.shards[hash(key) % self.modulus]
        if key not in shard:
            self._len += 1
            if self._len > SPLIT_AT and self.modulus == 1:
                shard[key] = value
                self._split()
                return
        shard[key] = value

    def grown(self, added: int) -> None:
        """Count ``added`` new entries set in ``shards`` directly, and split if the map
        is now big (the hot loops' inline insert; read ``shards`` again after)."""
        self._len += added
        if self._len > SPLIT_AT and self.modulus == 1:
            self._split()

    def _split(self) -> None:
        shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        for key, value in self.shards[0].items():
            shards[hash(key) % SHARDS][key] = value
        self.shards, self.modulus = shards, SHARDS

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        value = self.shards[hash(key) % self.modulus].pop(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._len -= 1
        return value

    def __delitem__(self, key: K) -> None:
        del self.shards[hash(key) % self.modulus][key]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def dismantle(self, step: int = 2048) -> Iterator[None]:
        """Empty it ``step`` entries at a time, pausing (``yield``) after each: a table
        of millions let go at once frees them all in one call (an order's ghosts at a
        million-block cache, 57 ms).  Nothing else may use it meanwhile."""
        yield from empty_in_steps(self.shards, step)
        self._len = 0

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self.shards)

    def keys(self) -> Iterator[K]:
        return iter(self)

    def values(self) -> Iterator[V]:
        return chain.from_iterable(s.values() for s in self.shards)

    def items(self) -> Iterator[tuple[K, V]]:
        return chain.from_iterable(s.items() for s in self.shards)

    def __repr__(self) -> str:
        return f"ShardedDict(entries={self._len}, shards={len(self.shards)})"


class FifoMap(Generic[K, V]):
    """The part of ``OrderedDict`` a ghost list uses (set, ``in``, ``pop``, ``del``,
    ``popitem(last=False)``, ``len``) with no table to rebuild as a whole.

    A ghost list of a million keys that evicts its oldest as it takes new ones runs out
    of room in its table every million insertions and rebuilds it in one go (an
    ``OrderedDict``'s: about 210 ms at 600k ghosts, the ghost lists of a 4.8M-block
    cache's miniatures).  Here the entries sit in a ``ShardedDict`` and their order in a
    ``deque`` of keys (no table: blocks of keys); a key taken out of the middle stays in
    the deque, counted stale, and is skipped when it comes to the front.  Setting a key
    held keeps its place, as in an ``OrderedDict``.

    A list whose keys are mostly taken out by ``pop`` (ghosts hit again) rarely gives
    up its oldest, so stale keys would pile up in the deque: once they outnumber the
    live ones (plus ``SLACK``), a turn begins, and each call moves ``STEP`` keys from the
    deque's front to a second deque (``_done``), dropping the stale ones, until the first
    is empty; keys set meanwhile wait in a third (``_later``).  The order is always
    ``_done``, then the deque, then ``_later``; at the turn's end they are one again.
    """

    __slots__ = ("_map", "_order", "_stale", "_done", "_later", "_turning")

    SLACK = 1024
    STEP = 2

    def __init__(self) -> None:
        self._map: ShardedDict[K, V] = ShardedDict()
        self._order: deque[K] = deque()  # oldest first, live and stale occurrences
        self._stale: ShardedDict[K, int] = ShardedDict()  # key -> its stale occurrences
        self._done: deque[K] = deque()   # in a turn: the keys moved so far, oldest first
        self._later: deque[K] = deque()  # in a turn: the keys set since it began
        self._turning = False

    # ``_map``'s reads inline below (a frame less a call: an eviction order asks its
    # ghosts about every key it takes)
    def __contains__(self, key: object) -> bool:
        held = self._map
        return key in held.shards[hash(key) % held.modulus]

    def __setitem__(self, key: K, value: V) -> None:
        held = self._map
        shard = held.shards[hash(key) % held.modulus]
        if key in shard:
            shard[key] = value  # its place kept
            return
        (self._later if self._turning else self._order).append(key)
        if self._turning or len(self._order) > 2 * held._len + self.SLACK:
            self._tidy()  # (its test inline: a frame less a call)
        shard[key] = value  # ``held[key] = value``, inline (``_tidy`` leaves the map)
        held._len += 1
        if held._len > SPLIT_AT and held.modulus == 1:
            held._split()

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        held = self._map
        value = held.shards[hash(key) % held.modulus].pop(key, _ABSENT)
        if value is _ABSENT:  # most of a miniature's inserts: a key never evicted
            if default is _MISSING:
                raise KeyError(key)
            return default
        held._len -= 1
        stale = self._stale
        counts = stale.shards[hash(key) % stale.modulus]
        if key in counts:
            counts[key] += 1
        else:
            stale[key] = 1
        if self._turning or len(self._order) > 2 * held._len + self.SLACK:
            self._tidy()
        return value

    def __delitem__(self, key: K) -> None:
        self.pop(key)

    def _drop_stale(self, key: K) -> bool:
        """Whether this occurrence of ``key`` is a stale one (then counted off)."""
        stale = self._stale
        left = stale.get(key)
        if left is None:
            return False
        if left > 1:
            stale[key] = left - 1
        else:
            del stale[key]
        return True

    def _tidy(self) -> None:
        """A few steps of a turn that drops the stale keys, begun when they outnumber
        the live ones; O(1) a call (but the turn's end, a deque extended)."""
        order = self._order
        if not self._turning:
            if len(order) <= 2 * self._map._len + self.SLACK:
                return
            self._turning = True
        done = self._done
        for _ in range(self.STEP):
            if not order:
                break
            key = order.popleft()
            if not self._drop_stale(key):
                done.append(key)
        if not order:
            self._end_turn()

    def _end_turn(self) -> None:
        """The deque is empty: the moved keys, then those set meanwhile, are the order."""
        done, later = self._done, self._later
        if len(done) >= len(later):
            done.extend(later)
            self._order = done
        else:
            later.extendleft(reversed(done))
            self._order = later
        self._done, self._later, self._turning = deque(), deque(), False

    def popitem(self, last: bool = True) -> tuple[K, V]:
        """The oldest entry, taken out (only ``last=False``: a ghost list's use)."""
        if last:
            raise NotImplementedError("FifoMap only gives up its oldest entry")
        held, stale = self._map, self._stale
        if not held._len:
            raise KeyError("popitem(): the map is empty")
        while True:
            if self._turning:
                if self._done:
                    key = self._done.popleft()
                elif self._order:
                    key = self._order.popleft()
                else:
                    self._end_turn()
                    continue
            else:
                key = self._order.popleft()
            # most keys are live: the stale counts' shard read inline
            if key not in stale.shards[hash(key) % stale.modulus] or not self._drop_stale(key):
                held._len -= 1
                return key, held.shards[hash(key) % held.modulus].pop(key)

    def dismantle(self, step: int = 2048) -> Iterator[None]:
        """``ShardedDict.dismantle`` of the whole (its map, its stale counts, its
        deques of keys)."""
        yield from self._map.dismantle(step)
        yield from self._stale.dismantle(step)
        for keys in (self._order, self._done, self._later):
            while keys:
                for _ in range(min(step, len(keys))):
                    keys.popleft()
                yield

    def oldest(self) -> tuple[K, V]:
        """The oldest entry, left in (the stale keys before it dropped), as
        ``next(iter(od.items()))`` of an ``OrderedDict``."""
        held, stale = self._map, self._stale
        if not held._len:
            raise KeyError("oldest(): the map is empty")
        while True:
            if self._turning and not self._done and not self._order:
                self._end_turn()
            keys = self._done if self._turning and self._done else self._order
            key = keys[0]
            if key not in stale.shards[hash(key) % stale.modulus] or not self._drop_stale(key):
                return key, held.shards[hash(key) % held.modulus][key]
            keys.popleft()

    def held(self) -> int:
        """Keys in the deque and waiting to join it, stale ones included."""
        return len(self._order) + len(self._done) + len(self._later)

    def __len__(self) -> int:
        return self._map._len

    def __bool__(self) -> bool:
        return self._map._len > 0

    def __repr__(self) -> str:
        return f"FifoMap(entries={len(self._map)}, stale={len(self._stale)})"


def empty_in_steps(tables: list[Any], step: int = 2048) -> Iterator[None]:
    """Empty each of ``tables`` (dicts, ordered or not: anything with ``popitem``
    and ``clear``) ``step`` entries at a time, pausing (``yield``) after each."""
    for table in tables:
        while table:
            if len(table) <= step:
                table.clear()
            else:
                for _ in range(step):
                    table.popitem()
            yield
