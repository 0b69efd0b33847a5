"""Soft pins over any eviction policy (``WarmPins``): blocks kept warm until a deadline,
given up only when nothing ordinary can go (re-exported by
``kvstore.scheduler.eviction``)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

from kvstore.scheduler.policy import EvictionPolicy

T = TypeVar("T", bound=Hashable)


class WarmPins(EvictionPolicy[T]):
    """Three priority classes over any policy: hard-pinned, kept warm, and ordinary.

    - A **hard pin** is the store's refcount pin (``pin``/``unpin``): never a victim.
    - A **soft pin** (``pin_soft(item, until)``) keeps an evictable item warm until the
      time ``until`` on the injected clock: it leaves the inner policy's order, so
      eviction takes it only when no ordinary item passes ``allowed``, and then the
      one whose warmth ends first.  Soft-pinning again moves the deadline (to the later
      one); ``unpin_soft`` or the deadline passing hands the item back to the inner
      policy as if newly inserted (its hit history there is not kept).  A soft pin
      does not survive the item's removal.  Hard and soft pins combine: an item that
      is both is not a victim; when the hard pin goes it stays warm.
    - Everything else is ordered by the inner policy.

    Deadlines are checked lazily, on ``pop_victim`` and ``expire``; the clock is passed
    in (the daemon gives ``time.monotonic``, tests a counter), so the order stays pure.
    The deadlines are a heap: a warm victim is the first at its top that may go, read
    in deadline order without sorting the warm set (which a client can make as large as
    what it holds: a sort for every victim held the loop for seconds), and the heap is
    rebuilt from the warm items once stale entries (deadlines moved, items gone)
    outnumber them (a client warming the same blocks again and again grew it without
    bound).
    """

    def __init__(self, inner: EvictionPolicy[T], clock: Callable[[], float]) -> None:
        self.inner = inner
        self.name = inner.name
        self._clock = clock
        self._warm: dict[T, float] = {}  # item -> deadline
        self._deadlines: list[tuple[float, int, T]] = []  # heap, lazily pruned
        self._hard: set[T] = set()  # every hard-pinned item, warm or not
        self._warm_evictable = 0  # warm items that are not hard-pinned
        self._seq = itertools.count()

    def pin_soft(self, item: T, until: float) -> None:
        """Keep a committed item warm until ``until`` (the later of two deadlines)."""
        current = self._warm.get(item)
        if current is not None and current >= until:
            return
        if current is None:
            self.inner.remove(item)
            if item not in self._hard:
                self._warm_evictable += 1
        self._warm[item] = until
        heapq.heappush(self._deadlines, (until, next(self._seq), item))
        if len(self._deadlines) > 2 * len(self._warm) + 64:
            self._compact()

    def _compact(self) -> None:
        """The heap of the warm items' deadlines alone (in their first-pinned order for
        equal deadlines, as their own entries had)."""
        self._deadlines = [(until, next(self._seq), item) for item, until in self._warm.items()]
        heapq.heapify(self._deadlines)

    def unpin_soft(self, item: T) -> None:
        """End the item's warmth now; it rejoins the ordinary order."""
        if self._warm.pop(item, None) is not None:
            self.inner.insert(item)
            if item in self._hard:
                self.inner.pin(item)
            else:
                self._warm_evictable -= 1

    def pinned_inside(self) -> list[T]:
        """The items pinned in the inner order (hard-pinned, not kept warm)."""
        warm = self._warm
        return [item for item in self._hard if item not in warm]

    def is_pinned_inside(self, item: T) -> bool:
        """Whether ``item`` is pinned in the inner order (hard-pinned, not kept warm)."""
        return item in self._hard and item not in self._warm

    def warm_until(self, item: T) -> float | None:
        """The item's soft-pin deadline, or None if it is not kept warm."""
        return self._warm.get(item)

    def is_warm(self, item: T) -> bool:
        """Whether the item is soft-pinned (deadline not yet seen to pass)."""
        return item in self._warm

    def expire(self) -> int:
        """Hand every item whose warmth has ended back to the inner policy; how many."""
        now = self._clock()
        ended = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            until, _, item = heapq.heappop(self._deadlines)
            if self._warm.get(item) == until:
                self.unpin_soft(item)
                ended += 1
        return ended

    def insert(self, item: T) -> None:
        if item not in self._warm:
            self.inner.insert(item)

    def insert_many(self, items: Iterable[T]) -> None:
        warm = self._warm
        self.inner.insert_many(items if not warm else [i for i in items if i not in warm])

    def access(self, item: T) -> None:
        if item not in self._warm:
            self.inner.access(item)

    def access_many(self, items: Iterable[T]) -> None:
        warm = self._warm
        self.inner.access_many(items if not warm else [i for i in items if i not in warm])

    def pin(self, item: T) -> None:
        if item in self._hard:
            return
        self._hard.add(item)
        if item in self._warm:
            self._warm_evictable -= 1
        else:
            self.inner.pin(item)

    def unpin(self, item: T) -> None:
        if item not in self._hard:
            return
        self._hard.discard(item)
        if item in self._warm:
            self._warm_evictable += 1
        else:
            self.inner.unpin(item)

    def remove(self, item: T) -> None:
        hard = item in self._hard
        self._hard.discard(item)
        if self._warm.pop(item, None) is None:
            self.inner.remove(item)
        elif not hard:
            self._warm_evictable -= 1

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        self.expire()
        victim = self.inner.pop_victim(allowed)
        if victim is not None or not self._warm_evictable:
            return victim
        for item in self._by_deadline():
            if item not in self._hard and allowed(item):
                del self._warm[item]
                self._warm_evictable -= 1
                return item
        return None

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        if self._deadlines:  # soft pins that may end between two victims: one by one
            return super().pop_victims(allowed, count, take)
        # none (a warm item has a deadline on the heap): nothing expires, no warm
        # item is a victim, and ``pop_victim`` is the inner order's
        return self.inner.pop_victims(allowed, count, take)

    def _by_deadline(self) -> Iterator[T]:
        """The warm items, earliest deadline first, read off the heap (its
        entries still current) without sorting it: a frontier of heap positions, each
        one's children joining it as it is passed; stale entries at the top are dropped
        on the way."""
        heap, warm = self._deadlines, self._warm
        while heap and warm.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (until, _, item), at = heapq.heappop(frontier)
            if warm.get(item) == until:
                yield item
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def evictable(self) -> Iterator[T]:
        warm = [item for item in self._warm if item not in self._hard]
        return itertools.chain(self.inner.evictable(), warm)

    def __len__(self) -> int:
        return len(self.inner) + self._warm_evictable

    def release(self) -> None:
        self.inner.release()

    def expect(self, capacity: int) -> None:
        self.inner.expect(capacity)

    def __repr__(self) -> str:
        return f"WarmPins({self.inner!r}, warm={len(self._warm)}, hard={len(self._hard)})"
