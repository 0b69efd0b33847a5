"""Which items of a batch a duel samples, and their states (``Duel.insert_many``).

A duel samples a name if ``not (name_hash * GOLDEN) & mask`` (Fibonacci hashing: the
top bits of the product, spread over the sample however the names run).  A commit's
new blocks are decided at once, in loops in C, so that only a sampled block costs
Python of its own; split out of ``kvstore.scheduler.dueling`` to keep it one sitting.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from itertools import compress, count, repeat
from operator import and_, mul, not_
from typing import Any, TypeVar, cast

import numpy as np

T = TypeVar("T", bound=Hashable)

GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential ids over the sample
MASK64 = (1 << 64) - 1


def _little_endian(name_hash: Callable[[Any], int]) -> bool:
    """Whether ``name_hash`` reads a name's bytes as a little-endian int (the store's
    ``partial(int.from_bytes, byteorder="little")``)."""
    return (type(name_hash) is partial and name_hash.func == int.from_bytes
            and not name_hash.args and name_hash.keywords == {"byteorder": "little"})


def new_states(size: int, spots: list[int], names: list[int]) -> list[bool | int]:
    """The states of a batch of new items, those at ``spots`` sampled (``Duel._items``).

    ``Duel.insert_many`` takes a batch of new items at once: which are sampled
    (``sampled_in``) and their states come from loops in C over the whole batch, and
    only a sampled item costs Python of its own.  It makes the calls ``_insert_each``
    makes item by item, in the same order (the tests hold the two to each other), with
    one difference no decision sees: every item's state is set before the first
    sampled key's reference, where the loop sets each as it comes.  That reference
    reads only its parent's state, and only to find the parent's sampled node: a state
    not set yet sends it to the parent's name, which finds the same node (an unsampled
    name has none)."""
    states: list[bool | int] = [False] * size
    for at, name in zip(spots, names):
        states[at] = name << 1
    return states


def sampled_in(batch: list[T], name_hash: Callable[[Any], int],
               ghost_key: Callable[[Any], Hashable],
               mask: int) -> tuple[list[int], list[int]]:
    """The places in ``batch`` of the items sampled by ``mask``, and their names' hashes.

    As ``insert`` decides, ``not (name * GOLDEN) & mask``, in loops in C; where the
    names are keys of one length, a multiple of 8 bytes, and their hash their bytes
    read little-endian (the store's), on their first eight bytes with numpy (the
    product's low 64 bits are those of the name's), and only the sampled ones hashed
    (``int.from_bytes`` via a ``partial``: 0.15 us a call; numpy pays from 20 names)."""
    if _little_endian(name_hash) and len(batch) >= 20:
        keys = cast(list[bytes], list(map(ghost_key, batch)))
        try:
            lengths = set(map(len, keys))
            width = lengths.pop() if len(lengths) == 1 else 0
            joined = b"".join(keys) if width >= 8 and not width % 8 else b""
        except TypeError:  # names of another kind
            joined = b""
        if joined:
            low = np.frombuffer(joined, dtype="<u8")[::width // 8]
            mixed = (low * np.uint64(GOLDEN)) & np.uint64(mask)
            spots: list[int] = np.flatnonzero(mixed == 0).tolist()
            return spots, [name_hash(keys[at]) for at in spots]
    names = list(map(name_hash, map(ghost_key, batch)))
    spots = list(compress(count(), map(not_, map(and_, map(mul, names, repeat(GOLDEN)),
                                               repeat(mask)))))
    return spots, [names[at] for at in spots]
