"""The interface of an eviction order (``EvictionPolicy``), apart from the orders
themselves (``kvstore.scheduler.eviction``, ``kvstore.scheduler.density``), so that a
policy in a module of its own can be registered beside the others."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Final, Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class _GoOn:
    def __repr__(self) -> str:
        return "GO_ON"


GO_ON: Final = _GoOn()
"""What a ``pop_victims`` ``take`` returns when the victim's leaving changes no other
item's ``allowed`` and moves none in the order: an order may then look for the next
victim on from where this one was, not again from the coldest item (a walk past the
same refused items per victim)."""


def _itself(item: Hashable) -> Hashable:
    return item


class EvictionPolicy(ABC, Generic[T]):
    """Orders the evictable items of one slab class.

    ``ghost_key`` names an item in the ghost lists of the policies that keep them
    (S3-FIFO, ARC, SLRU): by default the item itself; the store passes the block's key,
    so that a block cached again after it left is known as the one remembered, and a
    ghost keeps only a key alive, not a whole entry."""

    name: str = ""
    ghost_key: Callable[[Hashable], Hashable] = staticmethod(_itself)

    @abstractmethod
    def insert(self, item: T) -> None:
        """A newly committed item, evictable now."""

    def insert_many(self, items: Iterable[T]) -> None:
        """``insert`` each, in order (one call for a commit's blocks)."""
        insert = self.insert
        for item in items:
            insert(item)

    @abstractmethod
    def access(self, item: T) -> None:
        """The item was hit (looked up, acquired or read); it may be pinned."""

    def access_many(self, items: Iterable[T]) -> None:
        """``access`` each, in order (one call for a chain's hits)."""
        access = self.access
        for item in items:
            access(item)

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
        """Take the coldest evictable item for which ``allowed`` holds, or None.  Taken:
        off the order, as ``remove`` would leave it (no ``remove`` of it follows)."""

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        """``pop_victim`` up to ``count`` times, each victim handed to ``take`` before
        the next is chosen (what ``take`` does to the items, ``allowed`` sees next,
        unless ``take`` returned ``GO_ON``: it changed no item's verdict), until it finds
        none: the victims, in order.  One call for a request's many victims: an order
        may override it to save its per-call work, with the same victims, in the same
        order, as its ``pop_victim`` one after another."""
        victims: list[T] = []
        pop = self.pop_victim
        while len(victims) < count and (victim := pop(allowed)) is not None:
            victims.append(victim)
            take(victim)
        return victims

    def adopt_tuning(self, learned: EvictionPolicy[T], scale: float) -> None:
        """Take the settings ``learned``, another instance of this policy, adapted to
        on a sample of this traffic, in a cache ``scale`` times smaller (an adaptive
        order's segment target; none for an order that adapts nothing)."""

    def recall(self, names: Iterable[Hashable]) -> None:
        """The names (``ghost_key``) of the latest victims of an order this one
        replaces, oldest first: remembered as its own ghosts would be, if it keeps any
        (a key that comes back was worth keeping), but as old ones, which say nothing
        of its segments' sizes."""

    @abstractmethod
    def evictable(self) -> Iterator[T]:
        """Every item the policy would give up, in no promised order (for checkers)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many evictable items it holds."""

    def release(self) -> None:
        """The policy is being replaced: let go of anything it keeps in the items
        themselves (an order in their links), so that no item keeps another alive."""

    def expect(self, capacity: int) -> None:
        """The cache will hold up to about ``capacity`` items (a store's tier as sized, a
        replay's cache), told before the first item; an order may size itself by it
        (``auto``'s sample: ``Duel.expect``)."""
