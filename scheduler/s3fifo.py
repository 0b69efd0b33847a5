"""S3-FIFO (Yang et al., SOSP 2023) as an eviction order (``s3fifo``; registered in
``kvstore.scheduler.eviction``, which re-exports it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

from kvstore.scheduler.linked import Queue, links_of, queue, release_links
from kvstore.scheduler.policy import EvictionPolicy
from kvstore.scheduler.sharded import FifoMap, ShardedDict

T = TypeVar("T", bound=Hashable)

_MISSING: Any = object()


class _S3Entry:
    """What S3-FIFO remembers of one tracked item."""

    __slots__ = ("freq", "in_main", "pinned", "tick")

    def __init__(self, in_main: bool) -> None:
        self.freq = 0
        self.in_main = in_main
        self.pinned = False
        self.tick = -1  # the clock at its last counted hit (-1: none yet)


class S3FIFOPolicy(EvictionPolicy[T]):
    """S3-FIFO (Yang et al., SOSP 2023): a small probation FIFO, a main FIFO, a ghost queue.

    New items enter the small FIFO (about ``small_ratio`` of the items tracked); one
    reaching its head is promoted to main (its count starting over there) if it was hit
    at least ``promote_threshold`` times since it entered, and otherwise evicted and
    remembered in the ghost queue (as many keys as items tracked, by ``ghost_ratio``).  An
    item inserted while its ghost is remembered goes straight to main.  Main is a FIFO
    with lazy promotion: a head item that was hit goes back to the tail with its
    frequency (capped at ``max_freq``) decremented; one that was not is evicted.  A hit
    only bumps a counter, so a one-pass scan flows through the small FIFO without
    flushing the main one.  Hits count at most once per item per tick (see the module
    docstring): the clock ticks on ``insert`` and ``pop_victim``.

    The store's ``allowed`` test is respected without reordering: an item that fails it
    is skipped and keeps its place.  A pinned item leaves its FIFO (keeping its queue
    and frequency) and rejoins that FIFO's tail when unpinned.  The policy does not know
    the capacity; it takes the most items it has tracked at once (pinned ones included)
    as the cache size, exact once the slab class has been full.  Not the number tracked
    now: the store evicts a reservation's victims before it inserts the new blocks,
    and the ghost history must not shrink in between.
    """

    name = "s3fifo"

    def __init__(
        self,
        small_ratio: float = 0.1,
        promote_threshold: int = 1,
        max_freq: int = 3,
        ghost_ratio: float = 1.0,
    ) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if not 1 <= promote_threshold <= max_freq:
            raise ValueError("promote_threshold must be in [1, max_freq]")
        if ghost_ratio < 0.0:
            raise ValueError(f"ghost_ratio must be >= 0, got {ghost_ratio}")
        self.small_ratio = small_ratio
        self.promote_threshold = promote_threshold
        self.max_freq = max_freq
        self.ghost_ratio = ghost_ratio
        self._entries: dict[T, _S3Entry] | ShardedDict[T, _S3Entry] = {}
        self._small: Queue[T] = OrderedDict()  # oldest first
        self._main: Queue[T] = OrderedDict()  # oldest first
        self._ghost: FifoMap[Hashable, None] = FifoMap()  # oldest first
        self._tick = 0  # logical clock: inserts and evictions so far
        self._size = 0  # the most items ever tracked at once: the cache size, once full

    @property
    def links(self) -> str | None:
        """The attributes its FIFOs live in (``LinkedOrder``), None for tables."""
        return links_of(self._small)

    @links.setter
    def links(self, links: str | None) -> None:
        """Its FIFOs in the items' links, and its entries in a ``ShardedDict`` (the
        store's: a dict and two ``OrderedDict`` of every block rebuilt their tables as
        they grew, 98 ms in one call at about 700k blocks)."""
        if self._entries or self._ghost:
            raise ValueError("an order's links are chosen while it is empty")
        self._small, self._main = queue(links), queue(links)
        if links is not None:
            self._entries = ShardedDict()

    def insert(self, item: T) -> None:
        if item in self._entries:
            return
        self._tick += 1
        in_main = self._ghost.pop(self.ghost_key(item), _MISSING) is not _MISSING
        self._entries[item] = _S3Entry(in_main)
        (self._main if in_main else self._small)[item] = None
        self._size = max(self._size, len(self._entries))

    def access(self, item: T) -> None:
        entry = self._entries.get(item)
        if entry is None or entry.tick == self._tick:
            return  # unknown, or already counted in this tick (lookup, then acquire)
        entry.tick = self._tick
        if entry.freq < self.max_freq:
            entry.freq += 1

    def pin(self, item: T) -> None:
        entry = self._entries.get(item)
        if entry is not None and not entry.pinned:
            entry.pinned = True
            del (self._main if entry.in_main else self._small)[item]

    def unpin(self, item: T) -> None:
        entry = self._entries.get(item)
        if entry is not None and entry.pinned:
            entry.pinned = False
            (self._main if entry.in_main else self._small)[item] = None

    def remove(self, item: T) -> None:
        entry = self._entries.pop(item, None)
        if entry is not None and not entry.pinned:
            del (self._main if entry.in_main else self._small)[item]

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        self._tick += 1
        small_first = len(self._small) >= self.small_ratio * self._size or not self._main
        if small_first:
            victim = self._evict_small(allowed)
            if victim is None:
                victim = self._evict_main(allowed)
        else:
            victim = self._evict_main(allowed)
            if victim is None:
                victim = self._evict_small(allowed)
        if victim is not None:
            del self._entries[victim]
        return victim

    def _evict_small(self, allowed: Callable[[T], bool]) -> T | None:
        promoted: list[T] = []
        victim: T | None = None
        for item in self._small:
            entry = self._entries[item]
            if entry.freq >= self.promote_threshold:
                promoted.append(item)
            elif allowed(item):
                victim = item
                break
        # Moved after the walk: an OrderedDict cannot change while it is iterated.
        for item in promoted:
            del self._small[item]
            self._main[item] = None
            entry = self._entries[item]
            entry.in_main = True
            entry.freq = 0
        if victim is not None:
            del self._small[victim]
            self._remember(victim)
        return victim

    def _evict_main(self, allowed: Callable[[T], bool]) -> T | None:
        # Each pass lowers every frequency it rotates, so after max_freq passes every
        # item is at zero and the next pass finds a victim if any item is allowed.
        for _ in range(self.max_freq + 1):
            rotated: list[T] = []
            victim: T | None = None
            for item in self._main:
                entry = self._entries[item]
                if entry.freq > 0:
                    rotated.append(item)
                elif allowed(item):
                    victim = item
                    break
            for item in rotated:
                self._main.move_to_end(item)
                self._entries[item].freq -= 1
            if victim is not None:
                del self._main[victim]
                return victim
            if not rotated:
                return None
        return None

    def _remember(self, item: T) -> None:
        self._ghost[self.ghost_key(item)] = None
        limit = self.ghost_ratio * self._size
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def evictable(self) -> Iterator[T]:
        return iter([*self._small, *self._main])

    def release(self) -> None:
        release_links(self._small, self._main)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __repr__(self) -> str:
        pinned = len(self._entries) - len(self)
        return (
            f"S3FIFOPolicy(small={len(self._small)}, main={len(self._main)}, "
            f"pinned={pinned}, ghost={len(self._ghost)})"
        )
