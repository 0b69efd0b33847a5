"""Eviction order: which unpinned committed block a full slab class gives up first.

A policy only orders items; it never frees memory.  The block store tells it what
happens to each item (inserted, accessed, pinned, unpinned, removed) and asks it for a
victim that passes the store's own test (leaf-first: a block something cached depends
on is never a victim).  One policy instance serves one slab class of one tier.

Policies: ``lru``; ``s3fifo`` and ``arc`` (scan-resistant); ``slru`` (an adaptive
segmented LRU); ``density`` (a learned hit density per class of blocks, after LHD, in
``kvstore.scheduler.density``); ``auto`` (the default: LRU, SLRU, ARC and density duelling,
victims by the one whose miniature cache hit most lately, see
``kvstore.scheduler.dueling``).  No single
order wins everywhere: on a real multi-turn chat trace SLRU is far ahead of LRU at 2% of
its blocks and 6% behind it at 25%; the duel follows whichever pays on the traffic at
hand and falls back to LRU where nothing else does.
``WarmPins`` wraps any of them with soft pins that keep blocks warm until a deadline.

The store reports one request's hit twice (``lookup`` and ``acquire`` both call
``access``).  A policy must not read that as two references: ARC's and SLRU's ``access``
are idempotent (they only move the item to the MRU end of ``T2``, of the protected
segment), and S3-FIFO counts at most one hit per item per tick of a logical clock that
advances on every ``insert`` and ``pop_victim``, so hits with no cache churn between them
count once (the "correlated reference period" of LRU-K, O'Neil et al., SIGMOD 1993,
measured in churn).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from itertools import chain, islice
from typing import Any, Generic, TypeVar

from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.dueling import Duel, Order
from kvstore.scheduler.linked import LinkedOrder, Queue, links_of, queue, release_links
from kvstore.scheduler.policy import EvictionPolicy as EvictionPolicy  # re-exported
from kvstore.scheduler.s3fifo import S3FIFOPolicy as S3FIFOPolicy  # re-exported
from kvstore.scheduler.sharded import FifoMap, ShardedDict
from kvstore.scheduler.tracked import MapStates
from kvstore.scheduler.warm import WarmPins as WarmPins  # re-exported

T = TypeVar("T", bound=Hashable)

class LRUPolicy(EvictionPolicy[T]):
    """Least recently used first, O(1) per event; pinned items leave the order."""

    name = "lru"

    def __init__(self) -> None:
        # coldest first: in a table, or in the items' own links (``links``)
        self._order: Queue[T] = OrderedDict()
        self._pinned: set[T] = set()

    @property
    def links(self) -> str | None:
        """The attributes the order lives in (``LinkedOrder``), None for a table."""
        return links_of(self._order)

    @links.setter
    def links(self, links: str | None) -> None:
        if self._order or self._pinned:
            raise ValueError("an order's links are chosen while it is empty")
        self._order = queue(links)

    def insert(self, item: T) -> None:
        self._order[item] = None

    def insert_many(self, items: Iterable[T]) -> None:
        order = self._order
        if isinstance(order, LinkedOrder):
            order.extend(items)
        else:
            order.update(dict.fromkeys(items))  # new ones at the end, as one by one

    def access(self, item: T) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def access_many(self, items: Iterable[T]) -> None:
        order = self._order
        if isinstance(order, LinkedOrder):
            order.touch_many(items)
            return
        to_end = order.move_to_end
        for item in items:
            if item in order:
                to_end(item)

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
        order = self._order
        # the oldest, most often the victim: read, no generator for it
        item = order.oldest() if isinstance(order, LinkedOrder) else next(iter(order), None)
        if item is None:
            return None
        if not allowed(item):
            item = _first_allowed(islice(order, 1, None), allowed)
            if item is None:
                return None
        del order[item]
        return item

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        # ``pop_victim``'s steps in one loop: no call of it per victim
        order = self._order
        if isinstance(order, LinkedOrder):  # (the store's: the loop in its links)
            return order.take_oldest(allowed, count, take)
        return super().pop_victims(allowed, count, take)

    def evictable(self) -> Iterator[T]:
        return iter(list(self._order))

    def coldest(self) -> Iterator[T]:
        """The evictable items, the next victim first (live: do not change the policy
        while iterating)."""
        return iter(self._order)

    def release(self) -> None:
        release_links(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"LRUPolicy(evictable={len(self._order)}, pinned={len(self._pinned)})"


class ARCPolicy(EvictionPolicy[T]):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    ``T1`` holds items seen once recently, ``T2`` items hit since they entered; each is
    LRU-ordered, with a ghost list (``B1``, ``B2``) of the keys it evicted.  Inserting a
    key remembered in a ghost list moves the target size ``p`` of ``T1`` towards the
    list that would have kept it, and puts the item in ``T2``.  A victim comes from
    ``T1`` while it is above its target, else from ``T2``; the first item that passes
    ``allowed`` is taken, the others keep their places.  A pinned item leaves its list
    and rejoins its MRU end on unpin (in ``T2`` if it was hit meanwhile).  As with
    S3-FIFO, the cache size ``c`` is the most items tracked at once, pinned ones included.
    """

    name = "arc"

    def __init__(self) -> None:
        # LRU first, each in a table or both in the items' links (``links``); an item's
        # list is where it sits (no map of every tracked item)
        self._t1: Queue[T] = OrderedDict()
        self._t2: Queue[T] = OrderedDict()
        self._b1: FifoMap[Hashable, None] = FifoMap()  # ghosts, by ghost_key
        self._b2: FifoMap[Hashable, None] = FifoMap()
        self._pinned: dict[T, bool] = {}  # pinned items, off both lists: in T2?
        self._target_t1 = 0.0
        self._size = 0  # the most items ever tracked at once: the cache size, once full

    @property
    def links(self) -> str | None:
        """The attributes both lists live in (``LinkedOrder``), None for tables."""
        return links_of(self._t1)

    @links.setter
    def links(self, links: str | None) -> None:
        if self._t1 or self._t2 or self._pinned:
            raise ValueError("an order's links are chosen while it is empty")
        self._t1, self._t2 = queue(links), queue(links)

    def insert(self, item: T) -> None:
        if item in self._t1 or item in self._t2 or item in self._pinned:
            return
        self.insert_new(item)

    def insert_new(self, item: T) -> None:
        """``insert`` of an item it does not hold (a duel's miniature knows it does not:
        the three lookups spared, a sampled key's every reference passing here)."""
        t1, t2 = self._t1, self._t2
        size = max(1, self._size)
        ghost = self.ghost_key(item)
        if ghost in self._b1:
            grow = max(1.0, len(self._b2) / max(1, len(self._b1)))
            self._target_t1 = min(float(size), self._target_t1 + grow)
            del self._b1[ghost]
            t2[item] = None
        elif ghost in self._b2:
            shrink = max(1.0, len(self._b1) / max(1, len(self._b2)))
            self._target_t1 = max(0.0, self._target_t1 - shrink)
            del self._b2[ghost]
            t2[item] = None
        else:
            t1[item] = None
        tracked = len(t1) + len(t2) + len(self._pinned)
        if tracked > self._size:
            self._size = tracked

    def insert_many(self, items: Iterable[T]) -> None:
        t1, t2, pinned = self._t1, self._t2, self._pinned
        if self._b1 or self._b2:  # a ghost hit moves the target by the size so far
            for item in items:  # ``insert`` each
                if item not in t1 and item not in t2 and item not in pinned:
                    self.insert_new(item)
            return
        # No ghost yet (a fresh order, one taking over, a cache still filling): each new
        # item joins T1, and the size is the count at the end.
        for item in items:
            if item not in t1 and item not in t2 and item not in pinned:
                t1[item] = None
        self._size = max(self._size, len(t1) + len(t2) + len(pinned))

    def access(self, item: T) -> None:
        self.access_many((item,))

    def access_many(self, items: Iterable[T]) -> None:
        t1, t2, pinned = self._t1, self._t2, self._pinned
        to_end = t2.move_to_end
        for item in items:
            if item in t2:
                to_end(item)
            elif item in t1:
                del t1[item]
                t2[item] = None
            elif item in pinned:
                pinned[item] = True

    def pin(self, item: T) -> None:
        if item in self._t2:
            del self._t2[item]
            self._pinned[item] = True
        elif item in self._t1:
            del self._t1[item]
            self._pinned[item] = False

    def unpin(self, item: T) -> None:
        in_t2 = self._pinned.pop(item, None)
        if in_t2 is not None:
            (self._t2 if in_t2 else self._t1)[item] = None

    def remove(self, item: T) -> None:
        if self._pinned.pop(item, None) is not None:
            return
        if self._t1.pop(item, _MISSING) is _MISSING:
            self._t2.pop(item, None)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        t1_first = len(self._t1) > self._target_t1 or not self._t2
        order = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        for queue in order:
            # the oldest, most often the victim: read, no generator for it
            victim = queue.oldest() if isinstance(queue, LinkedOrder) else next(iter(queue), None)
            if victim is not None and not allowed(victim):
                victim = _first_allowed(islice(queue, 1, None), allowed)
            if victim is not None:
                del queue[victim]
                (self._b1 if queue is self._t1 else self._b2)[self.ghost_key(victim)] = None
                self._trim_ghosts()
                return victim
        return None

    def adopt_tuning(self, learned: EvictionPolicy[T], scale: float) -> None:
        """``T1``'s target size as ``learned`` has it, at this cache's scale."""
        if isinstance(learned, ARCPolicy):
            self._target_t1 = min(learned._target_t1 * scale, float(max(1, self._size)))

    def _trim_ghosts(self) -> None:
        size = self._size
        while self._b1 and len(self._t1) + len(self._b1) > size:
            self._b1.popitem(last=False)
        while self._b2 and len(self._b1) + len(self._b2) > size:
            self._b2.popitem(last=False)

    def evictable(self) -> Iterator[T]:
        return iter([*self._t1, *self._t2])

    def release(self) -> None:
        release_links(self._t1, self._t2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __repr__(self) -> str:
        return (
            f"ARCPolicy(t1={len(self._t1)}, t2={len(self._t2)}, pinned={len(self._pinned)}, "
            f"b1={len(self._b1)}, b2={len(self._b2)}, target_t1={self._target_t1:.1f})"
        )


class SLRUPolicy(EvictionPolicy[T]):
    """Adaptive segmented LRU: a probation segment for items seen once and a protected
    one for items hit since they entered (or whose key came back from the ghost list),
    each LRU-ordered, the probation segment held to a target size that adapts.

    What sets it apart from ARC is which ghost hits move the target: only *recent* ones.
    A key evicted from probation that comes back within ``window`` times the cache size
    evictions of that segment says probation was too small, and grows it by one; one
    evicted from the protected segment that soon shrinks it by one.  Older ghost hits
    say nothing about the margin and leave it alone (ARC counts every ghost hit however
    old; on the shared serving trace, where most blocks are seen once and reused ones
    come back late, that drives its probation segment to LRU's size).

    A victim comes from probation while it is above its target, else from the protected
    segment; at most ``skip`` items that may not go (a prefix whose child is cached) are
    passed over there before the other segment is tried, then the first one fully, so a
    reused prefix whose newest blocks sit in probation does not pin the search.  A hit
    moves an item to the protected segment's MRU end (so a hit reported twice counts
    once).  Ghost keys are at most ``ghost`` times the cache size, the most items
    tracked at once.  O(1) per call but ``pop_victim``, which is O(1) plus the items it
    passes over, as for the other policies.
    """

    name = "slru"

    def __init__(self, *, ghost: float = 2.0, window: float = 0.25, skip: int = 8) -> None:
        self.ghost_ratio = ghost
        self.window = window
        self.skip = skip
        # LRU first, each in a table or both in the items' links (``links``)
        self._probation: Queue[T] = OrderedDict()
        self._protected: Queue[T] = OrderedDict()
        # pinned items, off both segments: whether each rejoins the protected one.  An
        # item's segment is otherwise where it sits: no map of every tracked item (it
        # would cost a dict entry per block of the index).
        self._pinned: dict[T, bool] = {}
        # evicted keys: from the protected segment?, that segment's eviction count then
        self._ghost: FifoMap[Hashable, tuple[bool, int]] = FifoMap()
        self._evicted = [0, 0]  # evictions from probation, from the protected segment
        self._size = 0  # the most items ever tracked at once: the cache size, once full
        self._target = 0.0  # probation's target size, items

    @property
    def links(self) -> str | None:
        """The attributes both segments live in (``LinkedOrder``), None for tables."""
        return links_of(self._probation)

    @links.setter
    def links(self, links: str | None) -> None:
        if self._probation or self._protected or self._pinned:
            raise ValueError("an order's links are chosen while it is empty")
        self._probation, self._protected = queue(links), queue(links)

    def insert(self, item: T) -> None:
        if item in self._probation or item in self._protected or item in self._pinned:
            return
        self.insert_new(item)

    def insert_new(self, item: T) -> None:
        """``insert`` of an item it does not hold (as ``ARCPolicy.insert_new``)."""
        remembered = self._ghost.pop(self.ghost_key(item), None) if self._ghost else None
        if remembered is None:
            self._probation[item] = None
        else:
            self._protected[item] = None
            self._remembered(*remembered)
        tracked = len(self._probation) + len(self._protected) + len(self._pinned)
        if tracked > self._size:
            self._size = tracked

    def insert_many(self, items: Iterable[T]) -> None:
        probation, protected, pinned = self._probation, self._protected, self._pinned
        ghost, key = self._ghost, self.ghost_key
        if not ghost:  # none remembered (a fresh order, a cache still filling): one call
            fresh = [item for item in items
                     if item not in probation and item not in protected and item not in pinned]
            if isinstance(probation, LinkedOrder):
                probation.extend(fresh)
            else:
                probation.update(dict.fromkeys(fresh))
            self._size = max(self._size, len(probation) + len(protected) + len(pinned))
            return
        for item in items:
            if item in probation or item in protected or item in pinned:
                continue
            remembered = ghost.pop(key(item), None) if ghost else None
            if remembered is None:
                probation[item] = None
            else:
                protected[item] = None
                self._remembered(*remembered)
        tracked = len(probation) + len(protected) + len(pinned)
        if tracked > self._size:
            self._size = tracked

    def _remembered(self, from_protected: bool, then: int) -> None:
        """A key came back from the ghost list: a recent one moves the target."""
        tracked = len(self._probation) + len(self._protected) + len(self._pinned)
        if tracked > self._size:
            self._size = tracked
        if self._evicted[from_protected] - then < self.window * self._size:
            self._target += -1.0 if from_protected else 1.0
            self._target = min(max(self._target, 0.0), float(self._size))

    def access(self, item: T) -> None:
        self.access_many((item,))

    def access_many(self, items: Iterable[T]) -> None:
        probation, protected, pinned = self._probation, self._protected, self._pinned
        to_end = protected.move_to_end
        for item in items:
            if item in protected:
                to_end(item)
            elif item in probation:
                del probation[item]
                protected[item] = None
            elif item in pinned:
                pinned[item] = True

    def pin(self, item: T) -> None:
        if item in self._protected:
            del self._protected[item]
            self._pinned[item] = True
        elif item in self._probation:
            del self._probation[item]
            self._pinned[item] = False

    def unpin(self, item: T) -> None:
        protected = self._pinned.pop(item, None)
        if protected is not None:
            (self._protected if protected else self._probation)[item] = None

    def remove(self, item: T) -> None:
        if self._pinned.pop(item, None) is not None:
            return
        if self._probation.pop(item, _MISSING) is _MISSING:
            self._protected.pop(item, None)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        if len(self._probation) > self._target or not self._protected:
            first, second = self._probation, self._protected
        else:
            first, second = self._protected, self._probation
        # the oldest, most often the victim: read, no generator for it
        head = first.oldest() if isinstance(first, LinkedOrder) else next(iter(first), None)
        if head is not None:
            if allowed(head):
                return self._evict(first, head)
            for item in islice(first, 1, self.skip):  # up to ``skip`` passed over
                if allowed(item):
                    return self._evict(first, item)
        for queue in (second, first):
            for item in queue:
                if allowed(item):
                    return self._evict(queue, item)
        return None

    def adopt_tuning(self, learned: EvictionPolicy[T], scale: float) -> None:
        """The probation segment's target as ``learned`` has it, at this cache's scale."""
        if isinstance(learned, SLRUPolicy):
            self._target = min(learned._target * scale, float(self._size))

    def recall(self, names: Iterable[Hashable]) -> None:
        # Not trimmed here: handed over mid-eviction, this order may hold fewer items
        # than the cache does; its next evictions trim the list to its size then.
        ghost, old = self._ghost, (False, -(1 << 62))  # older than any window: no target move
        for name in names:
            ghost[name] = old

    def _evict(self, queue: Queue[T], item: T) -> T:
        del queue[item]
        from_protected = queue is self._protected
        self._evicted[from_protected] += 1
        self._ghost[self.ghost_key(item)] = (from_protected, self._evicted[from_protected])
        while len(self._ghost) > self.ghost_ratio * self._size:
            self._ghost.popitem(last=False)
        return item

    def evictable(self) -> Iterator[T]:
        return iter([*self._probation, *self._protected])

    def release(self) -> None:
        release_links(self._probation, self._protected)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __repr__(self) -> str:
        return (
            f"SLRUPolicy(probation={len(self._probation)}, protected={len(self._protected)}, "
            f"pinned={len(self._pinned)}, ghost={len(self._ghost)}, "
            f"target={self._target:.1f})"
        )


def _first_allowed(queue: Iterable[T], allowed: Callable[[T], bool]) -> T | None:
    for item in queue:
        if allowed(item):
            return item
    return None


# Hit density keeps an entry per item (in a ``ShardedDict``) and ghosts of up to four
# times the cache: in charge 1.6 times SLRU's memory per block (685 against 427 bytes
# at 100k blocks after 300k misses, 943 in tables; ``eviction_cost.py --memory``), a
# hand-over to it 2.8 s of CPU per million items (``--handover``; in slices), more than
# twice SLRU's.  Past this many items held it is not elected; in charge, it hands over.
DENSITY_MOST = 1 << 20


class AutoPolicy(Duel[T], EvictionPolicy[T]):
    """The duel of LRU, SLRU, ARC and hit density (``kvstore.scheduler.dueling``):
    victims by the order whose miniature cache hit most lately, LRU's unless another
    does better.

    The miniatures see one key in eight (fewer in a cache of more than 64k blocks: at
    most 8192 keys a miniature, ``Duel.expect``); an election every 512 of their
    references (4096 of the cache's at one in eight), or as many as they hold if fewer
    (at least 64: a small cache's turn over faster), past hits weighing 0.9 times per
    512 references.  In the replay these do as well as miniatures of every key, at an
    eighth of the cost.  The density miniature refreshes its densities as often in the
    cache's references as the order would (every ``refresh`` >> ``sample_shift`` of its
    own; in a thinner sample every ``refresh`` >> 3: as many to learn from), and hands its
    histograms over with the order (``HitDensityPolicy.adopt_tuning``); past
    ``DENSITY_MOST`` items held it is not elected, and hands over if in charge.
    """

    name = "auto"

    def __init__(self, *, sample_shift: int = 3, epoch: int = 512, shortest: int = 64,
                 keep: float = 0.9) -> None:
        super().__init__([LRUPolicy, SLRUPolicy, ARCPolicy, HitDensityPolicy],
                         sample_shift=sample_shift, epoch=epoch, shortest=shortest, keep=keep,
                         most=(None, None, None, DENSITY_MOST))

    _links: str | None = None

    @property
    def links(self) -> str | None:
        """The attributes the order in charge lives in, whichever candidate it is (each
        keeps its lists in links: no table of every block to grow); the miniatures'
        orders live in their sampled keys' own links."""
        return self._links

    @links.setter
    def links(self, links: str | None) -> None:
        self._links = links
        if isinstance(self._order, (LRUPolicy, SLRUPolicy, ARCPolicy, HitDensityPolicy)):
            self._order.links = links
        # the items' states beside their links, where they have the attribute (the
        # store's blocks: ``dram_duel``): no map of every tracked item
        self.state_attr = None if links is None else f"{links}_duel"

    def _keyed(self, order: Order[T]) -> Order[T]:
        order = super()._keyed(order)
        if self._links is not None and isinstance(
                order, (LRUPolicy, SLRUPolicy, ARCPolicy, HitDensityPolicy)):
            order.links = self._links
        if isinstance(order, HitDensityPolicy):
            order.parent_of = self._parent  # read at each call, as ``ghost_key``
            if self._links is not None:  # the store's: no table of every block to grow
                order.spread()
        return order

    def _parent(self, item: T) -> T | None:
        return self.parent_of(item)

    def _let_go(self, order: Order[T]) -> None:
        if isinstance(order, EvictionPolicy):
            order.release()  # its items' links unset, for the next order to link them

    def release(self) -> None:
        """Let go of everything (the policy is done with): the orders' links unset,
        the miniatures' among them (they link the sampled keys' nodes), and the order in
        charge, which names its ghosts through this duel (a cycle), dropped, so that
        reference counting frees it all (the daemon's collector never walks it).  The
        items' states are unset too, where they hold them (every item tracked is listed
        or pinned), for the next duel to track them."""
        self._items.forget(chain(self._order.evictable(), self._pinned))
        self._let_go(self._order)
        for mini in self._minis:
            self._let_go(mini.order)
        self._order = self._factories[0]()
        self._minis, self._nodes, self._items = [], ShardedDict(), MapStates()
        self._pinned = {}
        self._gone.clear()
        self._aside = None
        self._lingering = []
        self._backlog.clear()  # (its store lets go of it at its next ``catch_up``)


_MISSING = object()

PolicyFactory = Callable[[], EvictionPolicy[T]]

POLICIES: dict[str, Callable[[], EvictionPolicy[Hashable]]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "slru": SLRUPolicy,
    "auto": AutoPolicy,
    "density": HitDensityPolicy,
}

DEFAULT_POLICY = "auto"


def make_policy(name: str, ghost_key: Callable[[Hashable], Hashable] | None = None,
                links: str | None = None,
                name_hash: Callable[[Any], int] | None = None) -> EvictionPolicy[Hashable]:
    """A fresh policy by its configured name (its ghosts named by ``ghost_key``, if
    given; see ``EvictionPolicy``; its lists kept in the items' ``<links>_*``
    attributes if given and the policy can, see ``LinkedOrder``; a duel's sample
    decided by ``name_hash`` of the names, if given, see ``Duel``)."""
    try:
        policy = POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
    if ghost_key is not None:
        policy.ghost_key = ghost_key
    if name_hash is not None and isinstance(policy, Duel):
        policy.name_hash = name_hash
    if links is not None and isinstance(
            policy, (LRUPolicy, SLRUPolicy, ARCPolicy, S3FIFOPolicy, AutoPolicy,
                     HitDensityPolicy)):
        policy.links = links
        if isinstance(policy, HitDensityPolicy):
            policy.spread()  # the store's: no table of every block to grow
    return policy
