"""A namespace's key -> entry map, split into sub-dicts so that no growth stalls the loop.

A Python dict grows by rebuilding its whole table in one go when it passes two thirds
full: at 700k entries that is one insert taking tens of milliseconds (measured by
``benchmarks/index_scale.py``), all of it on the event loop.  ``BlockMap`` spreads the
keys over ``SHARDS`` dicts by their hash (keys are hashes themselves, so the shards fill
evenly), which makes each rebuild a ``SHARDS``-th of the size, and the cost of a lookup
one more index.  A map starts as one dict and splits once it passes ``SPLIT_AT`` entries
(one pass over them, under a millisecond; at 32k entries the pass held one commit 7-8 ms
of a 1M-block ingest, ``index_scale.py``), so the many small namespaces cost no more
than before (just split, 4k entries take 168 KB of dicts rather than 148).  A split map
is not merged back.  Its iteration order, shard by shard, follows the keys' hashes,
which differ between processes (bytes' hashes are seeded).  It reads like the dict it
replaces; the hot loops (lookup, commit) index ``shards`` themselves
(``shards[hash(key) & blocks.mask]``) and call ``grown`` after.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Generic, TypeVar

V = TypeVar("V")

SHARDS = 256
SPLIT_AT = 1 << 12


class BlockMap(Generic[V]):
    """A dict of bytes keys in ``SHARDS`` sub-dicts (iteration order: shard by shard)."""

    __slots__ = ("shards", "mask")

    def __init__(self) -> None:
        self.shards: list[dict[bytes, V]] = [{}]
        self.mask = 0  # a key's shard: ``hash(key) & mask``

    def grown(self) -> None:
        """Split the one dict into ``SHARDS`` once it is big (call after inserting into a
        shard directly)."""
        if self.mask == 0 and len(self.shards[0]) > SPLIT_AT:
            shards: list[dict[bytes, V]] = [{} for _ in range(SHARDS)]
            mask = SHARDS - 1
            for key, value in self.shards[0].items():
                shards[hash(key) & mask][key] = value
            self.shards, self.mask = shards, mask

    def get(self, key: bytes, default: V | None = None) -> V | None:
        return self.shards[hash(key) & self.mask].get(key, default)

    def __getitem__(self, key: bytes) -> V:
        return self.shards[hash(key) & self.mask][key]

    def __setitem__(self, key: bytes, value: V) -> None:
        self.shards[hash(key) & self.mask][key] = value
        if self.mask == 0:
            self.grown()

    def __delitem__(self, key: bytes) -> None:
        del self.shards[hash(key) & self.mask][key]

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) & self.mask]

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __bool__(self) -> bool:
        return any(self.shards)

    def __iter__(self) -> Iterator[bytes]:
        return chain.from_iterable(self.shards)

    def keys(self) -> Iterator[bytes]:
        return iter(self)

    def values(self) -> Iterator[V]:
        return chain.from_iterable(s.values() for s in self.shards)

    def items(self) -> Iterator[tuple[bytes, V]]:
        return chain.from_iterable(s.items() for s in self.shards)

    def __repr__(self) -> str:
        return f"BlockMap(entries={len(self)}, shards={len(self.shards)})"
