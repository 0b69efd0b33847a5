"""The SSD tier's eviction order of a slab class: an LRU order per tenant, the victim
taken from the tenant furthest over its weighted share.

The SSD tier is one for all tenants (per-tenant arenas keep their DRAM apart, not
their SSD), and it kept one LRU order: a tenant that wrote more than the tier holds, in
a burst or on purpose, pushed every other tenant's copies out of it, as a shared DRAM
tier would without its shares.  So each tenant's copies are in an order of their own,
and a victim is the coldest copy of the tenant holding the most evictable copies per
unit of its weight (``server.tenant_weights``, 1 each by default): a tenant writing
past its share makes room among its own copies, and one under its share keeps them,
as in a shared DRAM tier.  Between tenants this is not recency: a tenant over its share
gives up copies it read a moment ago before another's it has not read for an hour.
With one tenant it is that tenant's LRU order, as before.

The tenants are kept ranked as their orders change: a heap of (items per weight,
tenant), an entry pushed each time a tenant's count changes and those that no longer
hold skipped where they come to the top (the heap is rebuilt once it holds twice as
many entries as there are tenants), so a victim costs O(log tenants), not a sort of
every tenant (at 1000 tenants holding copies, 64 victims held the loop 47 ms).  A
tenant whose order empties is forgotten.  ``coldest`` names the items in the order
victims are taken, tenant by tenant as the ranking turns, not one tenant's whole order
first: the remote store's write-back sends the copies it names before eviction comes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

from .policy import EvictionPolicy

T = TypeVar("T", bound=Hashable)


class TenantOrders(EvictionPolicy[T]):
    """One eviction order per tenant (``make``: a new, empty one; ``tenant_of``: an
    item's tenant), a victim from the tenant with the most copies for its weight."""

    name = "lru"

    def __init__(self, tenant_of: Callable[[T], str], make: Callable[[], EvictionPolicy[T]],
                 weights: Mapping[str, float]) -> None:
        self._tenant_of = tenant_of
        self._make = make
        self.weights = weights  # (the store's, live: a reload's new weights count at once)
        self.orders: dict[str, EvictionPolicy[T]] = {}
        self._capacity = 0
        # the ranking: (-items per weight, the order's number, tenant), one entry pushed
        # at each change of a tenant's count; an entry holds while its tenant's order is
        # the one numbered so and the count is as pushed.  Equal shares go to the order
        # made first (its number), as a stable sort of ``orders`` would.
        self._heap: list[tuple[float, int, str]] = []
        self._numbers: dict[str, int] = {}  # each tenant's order's number
        self._made = itertools.count()
        self._weighed: dict[str, float] = dict(weights)  # the weights the heap was made with

    def __repr__(self) -> str:
        return f"TenantOrders({len(self.orders)} tenants, {len(self)} items)"

    def _order(self, item: T) -> EvictionPolicy[T]:
        tenant = self._tenant_of(item)
        order = self.orders.get(tenant)
        if order is None:
            order = self.orders[tenant] = self._make()
            self._numbers[tenant] = next(self._made)
            if self._capacity:
                order.expect(self._capacity)
        return order

    def _forget_if_empty(self, item: T, order: EvictionPolicy[T]) -> None:
        if not len(order):
            tenant = self._tenant_of(item)
            if self.orders.get(tenant) is order and not _holds_pinned(order):
                del self.orders[tenant]
                del self._numbers[tenant]

    def _counted(self, tenant: str, order: EvictionPolicy[T]) -> None:
        """``tenant``'s count changed: its place in the ranking, pushed."""
        n = len(order)
        if n and self.orders.get(tenant) is order:
            weight = self.weights.get(tenant, 1.0)
            # every entry is keyed by the weights of the ranking's making (``_weighed``):
            # one keyed by weights changed since, then changed back, would not hold, and
            # its tenant would be dropped from the ranking
            if weight != self._weighed.get(tenant, 1.0) \
                    or len(self._heap) > 2 * len(self.orders) + 64:
                self._rank_again()
                return
            heapq.heappush(self._heap, (-n / weight, self._numbers[tenant], tenant))

    def _rank_again(self) -> None:
        """The heap made anew from the orders (O(tenants): once its stale entries are as
        many as the tenants, or the weights changed)."""
        weights = self._weighed = dict(self.weights)
        numbers = self._numbers
        self._heap = [(-len(order) / weights.get(tenant, 1.0), numbers[tenant], tenant)
                      for tenant, order in self.orders.items() if len(order)]
        heapq.heapify(self._heap)

    def _holds(self, entry: tuple[float, int, str]) -> bool:
        """Whether a heap entry is its tenant's place now."""
        key, number, tenant = entry
        order = self.orders.get(tenant)
        return (order is not None and self._numbers[tenant] == number
                and key == -len(order) / self._weighed.get(tenant, 1.0))

    def _first(self) -> tuple[float, int, str] | None:
        """The ranking's first entry that holds, left on the heap (those above it that
        no longer hold, dropped); None where no tenant holds evictable items."""
        heap = self._heap
        while heap and not self._holds(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _next_tenant(self, aside: list[tuple[float, int, str]],
                     passed: set[str]) -> str | None:
        """The first tenant of the ranking not in ``passed``, its entry taken off the
        heap into ``aside`` (with those of tenants passed: the caller puts them back);
        None when there is none."""
        heap = self._heap
        while (entry := self._first()) is not None:
            aside.append(heapq.heappop(heap))
            if entry[2] not in passed:
                return entry[2]
        return None

    def insert(self, item: T) -> None:
        order = self._order(item)
        order.insert(item)
        self._counted(self._tenant_of(item), order)

    def insert_many(self, items: Iterable[T]) -> None:
        for tenant, group in itertools.groupby(items, self._tenant_of):
            first = next(group)
            order = self._order(first)
            order.insert(first)
            order.insert_many(group)
            self._counted(tenant, order)

    def access(self, item: T) -> None:
        order = self.orders.get(self._tenant_of(item))
        if order is not None:
            order.access(item)

    def access_many(self, items: Iterable[T]) -> None:
        for tenant, group in itertools.groupby(items, self._tenant_of):
            order = self.orders.get(tenant)
            if order is not None:
                order.access_many(group)

    def pin(self, item: T) -> None:
        self._change(item, "pin")

    def unpin(self, item: T) -> None:
        self._change(item, "unpin")

    def remove(self, item: T) -> None:
        self._change(item, "remove")

    def _change(self, item: T, how: str) -> None:
        """``item``'s tenant's order does ``how`` to it (pin, unpin, remove), and the
        tenant's count is ranked again; nothing if the tenant has no order."""
        tenant = self._tenant_of(item)
        order = self.orders.get(tenant)
        if order is not None:
            getattr(order, how)(item)
            if how == "remove":
                self._forget_if_empty(item, order)
            self._counted(tenant, order)

    def ranked(self) -> list[EvictionPolicy[T]]:
        """The tenants' orders, the one to give up copies first first: most items for
        its weight (a tenant named in no weight weighs 1).  O(tenants log tenants)."""
        weights = self.weights
        weighed = [(order, weights.get(tenant, 1.0)) for tenant, order in self.orders.items()]
        weighed.sort(key=lambda ow: len(ow[0]) / ow[1], reverse=True)
        return [order for order, _ in weighed]

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        orders = self.orders
        if len(orders) == 1:
            only, order = next(iter(orders.items()))
            return self._pop_from(only, order, allowed)
        if self.weights != self._weighed:
            self._rank_again()
        aside: list[tuple[float, int, str]] = []
        tried: set[str] = set()  # tenants with nothing ``allowed`` passes
        try:
            while (tenant := self._next_tenant(aside, tried)) is not None:
                victim = self._pop_from(tenant, orders[tenant], allowed)
                if victim is not None:
                    return victim
                tried.add(tenant)
            return None
        finally:
            for entry in aside:  # (those that no longer hold go where they come up)
                heapq.heappush(self._heap, entry)

    def _pop_from(self, tenant: str, order: EvictionPolicy[T],
                  allowed: Callable[[T], bool]) -> T | None:
        victim = order.pop_victim(allowed)
        if victim is not None:
            if not len(order):
                self._forget_if_empty(victim, order)
            self._counted(tenant, order)
        return victim

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        victims: list[T] = []
        if self.weights != self._weighed:
            self._rank_again()
        weights = self.weights
        aside: list[tuple[float, int, str]] = []
        spent: set[str] = set()  # tenants with nothing this request may take
        try:
            while len(victims) < count:
                tenant = self._next_tenant(aside, spent)
                if tenant is None:
                    break
                # the first tenant's, as many as keep it the furthest over (one ranking
                # for them, not one a victim)
                order = self.orders[tenant]
                lead = count
                spent.add(tenant)  # (while the second is looked for)
                second = self._next_tenant(aside, spent)
                spent.discard(tenant)
                if second is not None:
                    lead = max(1, len(order) - int(len(self.orders[second])
                                                   * weights.get(tenant, 1.0)
                                                   / weights.get(second, 1.0)))
                got = order.pop_victims(allowed, min(count - len(victims), lead), take)
                if got:
                    if not len(order):
                        self._forget_if_empty(got[-1], order)
                    self._counted(tenant, order)
                    victims.extend(got)
                else:
                    spent.add(tenant)
                # the second's entry back: it may come first next (the first's, changed,
                # was pushed anew; unchanged, it is spent and stays aside)
                if second is not None:
                    heapq.heappush(self._heap, aside.pop())
        finally:
            for entry in aside:
                heapq.heappush(self._heap, entry)
        return victims

    def coldest(self) -> Iterator[T]:
        """The evictable items in the order victims are taken: each time the next of
        the tenant furthest over its share, as though the ones before it were taken
        (live: do not change the orders while iterating)."""
        orders = self.orders
        if len(orders) == 1:
            yield from next(iter(orders.values())).coldest()  # type: ignore[attr-defined]
            return
        weights, numbers = self.weights, self._numbers
        heap = [(-len(order) / weights.get(tenant, 1.0), numbers[tenant], len(order),
                 weights.get(tenant, 1.0), iter(order.coldest()))  # type: ignore[attr-defined]
                for tenant, order in orders.items() if len(order)]
        heapq.heapify(heap)
        while heap:
            _, number, left, weight, items = heap[0]
            yield next(items)
            left -= 1
            if left:
                heapq.heapreplace(heap, (-left / weight, number, left, weight, items))
            else:
                heapq.heappop(heap)

    def evictable(self) -> Iterator[T]:
        for order in list(self.orders.values()):
            yield from order.evictable()

    def __len__(self) -> int:
        return sum(map(len, self.orders.values()))

    def expect(self, capacity: int) -> None:
        self._capacity = capacity
        for order in self.orders.values():
            order.expect(capacity)

    def release(self) -> None:
        for order in self.orders.values():
            order.release()
        self.orders.clear()
        self._numbers.clear()
        self._heap.clear()

    def held(self) -> dict[str, int]:
        """Evictable items per tenant."""
        return {tenant: len(order) for tenant, order in self.orders.items()}


def _holds_pinned(order: EvictionPolicy[T]) -> bool:
    """Whether ``order`` keeps pinned items aside (an LRU order's ``_pinned``): an empty
    order that does is not forgotten, or their unpin would find none."""
    return bool(getattr(order, "_pinned", None))
