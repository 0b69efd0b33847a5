"""``TenantOrders``: an LRU order per tenant, each victim from the tenant with the most
items for its weight (the SSD tier's order)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstore.scheduler.eviction import make_policy
from kvstore.scheduler.tenant_orders import TenantOrders


@dataclass(frozen=True)
class Item:
    tenant: str
    n: int


def orders(weights: dict[str, float] | None = None) -> TenantOrders[Item]:
    return TenantOrders(lambda i: i.tenant, lambda: make_policy("lru"),  # type: ignore
                        weights or {})


def anything(item: Item) -> bool:
    return True


def drain(o: TenantOrders[Item], count: int) -> list[Item]:
    return [v for v in (o.pop_victim(anything) for _ in range(count)) if v is not None]


def test_one_tenant_is_plain_lru() -> None:
    o = orders()
    items = [Item("a", i) for i in range(6)]
    o.insert_many(items)
    o.access(items[1])
    assert [i.n for i in drain(o, 6)] == [0, 2, 3, 4, 5, 1]
    assert len(o) == 0 and o.orders == {}  # an emptied order is forgotten


def test_the_tenant_over_its_share_gives_up_its_own_coldest_first() -> None:
    o = orders()
    o.insert_many([Item("quiet", i) for i in range(2)])  # the oldest
    o.insert_many([Item("loud", i) for i in range(6)])
    victims = drain(o, 6)
    # loud's own, oldest first, till both hold as many; then each in turn
    assert [(v.tenant, v.n) for v in victims[:4]] == [("loud", i) for i in range(4)]
    assert sorted(v.tenant for v in victims[4:]) == ["loud", "quiet"]
    assert o.held() == {"loud": 1, "quiet": 1}


def test_weights_set_the_shares() -> None:
    o = orders({"big": 3.0})
    o.insert_many([Item("big", i) for i in range(6)])
    o.insert_many([Item("small", i) for i in range(6)])
    victims = drain(o, 4)  # small holds 6 for a weight of 1, big 6 for 3: small's go
    assert [v.tenant for v in victims] == ["small"] * 4
    assert o.held() == {"big": 6, "small": 2}
    assert drain(o, 1)[0].tenant == "big"  # 6/3 = 2/1: even, then big's first (its order came first)


def test_pinned_items_are_never_victims_and_keep_their_order() -> None:
    o = orders()
    a = [Item("a", i) for i in range(2)]
    o.insert_many(a)
    o.pin(a[0])
    o.pin(a[1])
    assert o.pop_victim(anything) is None
    assert "a" in o.orders  # (emptied of evictable items, but holding pinned ones)
    o.unpin(a[1])
    assert o.pop_victim(anything) is a[1]
    o.unpin(a[0])
    o.remove(a[0])
    assert o.orders == {}


def test_many_victims_at_once_are_those_taken_one_by_one() -> None:
    rng = random.Random(7)
    for _ in range(50):
        tenants = [f"t{i}" for i in range(rng.randint(1, 4))]
        items = [Item(rng.choice(tenants), i) for i in range(rng.randint(0, 40))]
        refused = {i for i in items if rng.random() < 0.2}

        def allowed(item: Item) -> bool:
            return item not in refused

        one, many = orders(), orders()
        one.insert_many(items)
        many.insert_many(items)
        count = rng.randint(1, 45)
        singly = [v for v in (one.pop_victim(allowed) for _ in range(count)) if v is not None]
        taken: list[Item] = []
        batch = many.pop_victims(allowed, count, taken.append)
        assert batch == taken
        assert len(batch) == len(singly)
        # the same tenants give up the same number of items (ties may go either way)
        assert sorted(v.tenant for v in batch) == sorted(v.tenant for v in singly)
        assert one.held() == many.held()
