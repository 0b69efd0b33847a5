"""A dict split into sub-dicts once it is big, so that no single insert rebuilds it all.

A Python dict grows by rebuilding its whole table when it passes two thirds full: in
the duel's map of every tracked item, at 5M blocks that is one insert holding the
event loop for 271 ms (``benchmarks/index_scale.py``).  ``ShardedDict`` starts as one
dict and, past ``SPLIT_AT`` entries, spreads them over ``SHARDS`` dicts by hash (one
pass, a few milliseconds, once), so that each later rebuild is about a ``SHARDS``-th of
the size.  The store's key map does the same for bytes keys (``kvstore.block_map``); this
one serves any hashable key and counts its entries, for the duel asks its size on
every insert.  The price is a Python call per operation instead of the dict's C one;
the hot loops index ``shards`` themselves (``shards[hash(key) % modulus]``), reading only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from itertools import chain
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Prime: the duel's keys are hashes of objects, from their addresses, which the
# allocator spaces evenly: 100k block entries took 64 of 256 shards by a mask (each
# four times the size, and one 0.7 s insert at 7.4M blocks), all 251 by this modulus
SHARDS = 251
SPLIT_AT = 1 << 15

_MISSING: Any = object()


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
