"""Eviction order: which unpinned committed block a full slab class gives up first.

A policy only orders items; it never frees memory.  The block store tells it what
happens to each item (inserted, accessed, pinned, unpinned, removed) and asks it for a
victim that passes the store's own test (leaf-first: a block something cached depends
on is never a victim).  One policy instance serves one slab class of one tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class EvictionPolicy(ABC, Generic[T]):
    """Orders the evictable items of one slab class."""

    name: str = ""

    @abstractmethod
    def insert(self, item: T) -> None:
        """A newly committed item, evictable now."""

    @abstractmethod
    def access(self, item: T) -> None:
        """The item was hit (looked up, acquired or read); it may be pinned."""

    @abstractmethod
    def pin(self, item: T) -> None:
        """The item is pinned: not evictable until ``unpin``."""

    @abstractmethod
    def unpin(self, item: T) -> None:
        """The last pin went: evictable again."""

    @abstractmethod
    def remove(self, item: T) -> None:
        """The item is gone (evicted, dropped, moved); forget it."""

    @abstractmethod
    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        """Take the coldest evictable item for which ``allowed`` holds, or None."""

    @abstractmethod
    def evictable(self) -> Iterator[T]:
        """Every item the policy would give up, in no promised order (for checkers)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many evictable items it holds."""


class LRUPolicy(EvictionPolicy[T]):
    """Least recently used first, O(1) per event; pinned items leave the order."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[T, None] = OrderedDict()  # coldest first
        self._pinned: set[T] = set()

    def insert(self, item: T) -> None:
        self._order[item] = None

    def access(self, item: T) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def pin(self, item: T) -> None:
        if self._order.pop(item, _MISSING) is not _MISSING:
            self._pinned.add(item)

    def unpin(self, item: T) -> None:
        if item in self._pinned:
            self._pinned.discard(item)
            self._order[item] = None

    def remove(self, item: T) -> None:
        self._order.pop(item, None)
        self._pinned.discard(item)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        for item in self._order:
            if allowed(item):
                del self._order[item]
                return item
        return None

    def evictable(self) -> Iterator[T]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"LRUPolicy(evictable={len(self._order)}, pinned={len(self._pinned)})"


_MISSING = object()

PolicyFactory = Callable[[], EvictionPolicy[T]]

POLICIES: dict[str, Callable[[], EvictionPolicy[Hashable]]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy[Hashable]:
    """A fresh policy by its configured name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
