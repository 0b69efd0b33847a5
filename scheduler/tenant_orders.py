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

Choosing the tenant costs O(tenants holding copies of the class) a victim, once a
request for its first victim and again only when that tenant's order runs out of
victims the request may take; a tenant whose order empties is forgotten.
"""

from __future__ import annotations

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

    def __repr__(self) -> str:
        return f"TenantOrders({len(self.orders)} tenants, {len(self)} items)"

    def _order(self, item: T) -> EvictionPolicy[T]:
        tenant = self._tenant_of(item)
        order = self.orders.get(tenant)
        if order is None:
            order = self.orders[tenant] = self._make()
            if self._capacity:
                order.expect(self._capacity)
        return order

    def _forget_if_empty(self, item: T, order: EvictionPolicy[T]) -> None:
        if not len(order):
            tenant = self._tenant_of(item)
            if self.orders.get(tenant) is order and not _holds_pinned(order):
                del self.orders[tenant]

    def insert(self, item: T) -> None:
        self._order(item).insert(item)

    def insert_many(self, items: Iterable[T]) -> None:
        for _, group in itertools.groupby(items, self._tenant_of):
            first = next(group)
            order = self._order(first)
            order.insert(first)
            order.insert_many(group)

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
        order = self.orders.get(self._tenant_of(item))
        if order is not None:
            order.pin(item)

    def unpin(self, item: T) -> None:
        order = self.orders.get(self._tenant_of(item))
        if order is not None:
            order.unpin(item)

    def remove(self, item: T) -> None:
        order = self.orders.get(self._tenant_of(item))
        if order is not None:
            order.remove(item)
            self._forget_if_empty(item, order)

    def ranked(self) -> list[EvictionPolicy[T]]:
        """The tenants' orders, the one to give up copies first first: most items for
        its weight (a tenant named in no weight weighs 1)."""
        return [order for order, _ in self._ranked()]

    def _ranked(self) -> list[tuple[EvictionPolicy[T], float]]:
        """``ranked``, each order with its tenant's weight."""
        orders = self.orders
        if len(orders) == 1:
            return [(order, 1.0) for order in orders.values()]
        weights = self.weights
        weighed = [(order, weights.get(tenant, 1.0)) for tenant, order in orders.items()]
        weighed.sort(key=lambda ow: len(ow[0]) / ow[1], reverse=True)
        return weighed

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        orders = self.orders
        for order in (orders.values() if len(orders) == 1 else self.ranked()):
            victim = order.pop_victim(allowed)
            if victim is not None:
                if not len(order):
                    self._forget_if_empty(victim, order)
                return victim
        return None

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        victims: list[T] = []
        spent: set[int] = set()  # orders with nothing this request may take
        while len(victims) < count:
            ranked = [ow for ow in self._ranked() if id(ow[0]) not in spent]
            if not ranked:
                break
            # the first tenant's, as many as keep it the furthest over (one ranking for
            # them, not one a victim)
            order, weight = ranked[0]
            lead = count
            if len(ranked) > 1:
                second, second_weight = ranked[1]
                lead = max(1, len(order) - int(len(second) * weight / second_weight))
            got = order.pop_victims(allowed, min(count - len(victims), lead), take)
            if got:
                if not len(order):
                    self._forget_if_empty(got[-1], order)
                victims.extend(got)
            else:
                spent.add(id(order))
        return victims

    def coldest(self) -> Iterator[T]:
        """The evictable items, the tenant to give up copies first first, each tenant's
        coldest first (live: do not change the orders while iterating)."""
        for order in self.ranked():
            yield from order.coldest()  # type: ignore[attr-defined]

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

    def held(self) -> dict[str, int]:
        """Evictable items per tenant."""
        return {tenant: len(order) for tenant, order in self.orders.items()}


def _holds_pinned(order: EvictionPolicy[T]) -> bool:
    """Whether ``order`` keeps pinned items aside (an LRU order's ``_pinned``): an empty
    order that does is not forgotten, or their unpin would find none."""
    return bool(getattr(order, "_pinned", None))
