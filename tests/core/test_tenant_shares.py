"""Tenants sharing one DRAM tier: a tenant over its weighted share is evicted first, and a
tenant at its quota makes room among its own blocks (or is refused, leaving no trace)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st
from kvtest import make_identity

from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Namespace

A = make_identity(tenant="a")
B = make_identity(tenant="b")
SLOT = A.block_bytes  # 8 KiB, already a multiple of the alignment


def store_of(slots: int, **kw: object) -> BlockStore:
    return BlockStore(slots * SLOT, slots * SLOT, **kw)  # type: ignore[arg-type]


def put(store: BlockStore, ns: Namespace, first: int, count: int, now: float) -> list[bytes]:
    """``count`` one-block chains (each its own root), committed at ``now``."""
    keys = []
    for i in range(first, first + count):
        key = chain_keys(ns.id, list(range(i * 16, (i + 1) * 16)), 16)[0]
        r = store.reserve(ns.tenant, ns, [key], None, now)
        store.commit(ns.tenant, r.id, now)
        keys.append(key)
    return keys


def cached(ns: Namespace, keys: list[bytes]) -> int:
    return sum(1 for k in keys if (b := ns.blocks.get(k)) is not None and b.offset is not None)


def test_a_tenant_over_its_share_is_evicted_first() -> None:
    store = store_of(16)
    a, b = store.open_namespace(A), store.open_namespace(B)
    b_keys = put(store, b, 0, 6, now=0.0)          # b's blocks are the coldest
    a_keys = put(store, a, 100, 10, now=1.0)       # the tier is full; a holds 10 of 16
    more = put(store, a, 200, 4, now=2.0)          # a keeps writing: its own blocks go
    assert cached(b, b_keys) == 6
    assert cached(a, a_keys) + cached(a, more) == 10
    put(store, b, 300, 2, now=3.0)                 # b, under its share of 8, takes from a
    assert cached(b, b_keys) == 6 and store.drams[""].used == {"a": 8 * SLOT, "b": 8 * SLOT}
    store.check_invariants()


def test_weights_set_the_shares() -> None:
    store = store_of(16, tenant_weights={"a": 3.0})
    a, b = store.open_namespace(A), store.open_namespace(B)
    b_keys = put(store, b, 0, 4, now=0.0)          # share of b: 4 of 16
    put(store, a, 100, 12, now=1.0)
    put(store, a, 200, 6, now=2.0)                 # a is at its share of 12: its own go
    assert cached(b, b_keys) == 4
    put(store, b, 300, 2, now=3.0)                 # b over its share of 4: b's own go
    assert store.drams[""].used == {"a": 12 * SLOT, "b": 4 * SLOT}
    store.check_invariants()


def test_under_plain_lru_the_cold_tenant_would_lose_its_blocks() -> None:
    """The contrast: one tenant alone in the tier evicts by recency only."""
    store = store_of(16)
    b = store.open_namespace(B)
    first = put(store, b, 0, 6, now=0.0)
    put(store, b, 100, 16, now=1.0)
    assert cached(b, first) == 0


def test_a_tenant_at_its_quota_evicts_its_own_blocks() -> None:
    store = store_of(16, tenant_quota=4 * SLOT)
    a, b = store.open_namespace(A), store.open_namespace(B)
    b_keys = put(store, b, 0, 3, now=0.0)
    a_keys = put(store, a, 100, 10, now=1.0)       # the tier has room, the quota does not
    assert store.drams[""].used["a"] == 4 * SLOT
    assert cached(a, a_keys) == 4 and cached(a, a_keys[-4:]) == 4
    assert cached(b, b_keys) == 3
    store.check_invariants()


def test_a_tenant_at_its_quota_with_everything_pinned_is_refused_cleanly() -> None:
    store = store_of(16, tenant_quota=2 * SLOT)
    a = store.open_namespace(A)
    keys = put(store, a, 0, 2, now=0.0)
    pin = store.acquire("a", a, keys[:1], 1.0)
    pin2 = store.acquire("a", a, keys[1:], 1.0)
    before = dict(store.drams[""].used)
    key = chain_keys(a.id, list(range(1000, 1016)), 16)[0]
    with pytest.raises(CapacityError, match="quota"):
        store.reserve("a", a, [key], None, 2.0)
    assert store.drams[""].used == before and store.reserved_slots == 0
    store.release("a", pin.id)
    store.release("a", pin2.id)
    store.reserve("a", a, [key], None, 3.0)        # now one of its own blocks can go
    store.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 5)), min_size=1,
                max_size=40),
       st.sampled_from([0, 3, 6]))
def test_accounting_holds_under_any_mix(ops: list[tuple[str, int]], quota_slots: int) -> None:
    store = store_of(12, tenant_quota=quota_slots * SLOT)
    spaces = {t: store.open_namespace(make_identity(tenant=t)) for t in "abc"}
    for step, (tenant, count) in enumerate(ops):
        try:
            put(store, spaces[tenant], step * 10, count, now=float(step))
        except CapacityError:
            pass
        store.check_invariants()
        if quota_slots:
            assert all(v <= quota_slots * SLOT for v in store.drams[""].used.values())
    assert sum(store.drams[""].used.values()) == store.committed_slots * SLOT


def test_a_request_the_quota_can_never_hold_is_refused_without_evicting() -> None:
    store = store_of(16, tenant_quota=4 * SLOT)
    a = store.open_namespace(A)
    keys = put(store, a, 0, 4, now=0.0)
    chain = chain_keys(a.id, list(range(5000, 5000 + 5 * 16)), 16)
    with pytest.raises(CapacityError, match="quota"):
        store.reserve("a", a, chain, None, 1.0)            # five blocks, quota four
    assert cached(a, keys) == 4
    store.check_invariants()


def test_a_partly_pinned_tenant_short_of_room_is_refused_without_evicting() -> None:
    store = store_of(16, tenant_quota=4 * SLOT)
    a = store.open_namespace(A)
    keys = put(store, a, 0, 4, now=0.0)
    pin = store.acquire("a", a, keys[:3], 1.0)              # one block left to evict
    chain = chain_keys(a.id, list(range(5000, 5000 + 2 * 16)), 16)
    with pytest.raises(CapacityError, match="quota"):
        store.reserve("a", a, chain, None, 2.0)            # needs two
    assert cached(a, keys) == 4
    store.release("a", pin.id)
    store.check_invariants()


def test_the_quota_makes_room_among_the_tenants_blocks_of_any_size() -> None:
    store = BlockStore(64 * SLOT, 16 * SLOT, tenant_quota=8 * SLOT)
    a = store.open_namespace(A)
    a2 = store.open_namespace(make_identity(tenant="a", head_dim=64))  # twice the size
    put(store, a, 0, 8, now=0.0)                            # the quota, in small blocks
    put(store, a2, 100, 1, now=1.0)                         # a big one: two small go
    assert store.drams[""].used["a"] == 8 * SLOT
    assert sum(1 for b in a.blocks.values() if b.offset is not None) == 6
    store.check_invariants()


def test_an_empty_reservation_holds_nothing_and_is_charged_nothing() -> None:
    store = store_of(16)
    a = store.open_namespace(A)
    r = store.reserve("a", a, [], None, 1.0)               # as a fuzzer sends it
    assert r.offsets == []
    store.check_invariants()
    store.abort("a", r.id)
    store.check_invariants()


def test_a_tenant_over_its_share_finds_its_victims_past_the_cold_ones_in_one_walk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The victims of a tenant over its share lie behind another tenant's colder blocks
    (under its share: kept).  Each victim was looked for from the coldest block again,
    every one of those walked past once per victim: a put of 512 blocks into a full tier
    held the loop 100 ms once the other tenant had 2000 blocks cold there.  Now the
    request's victims come in one walk: the blocks looked at, counted, stay near what is
    passed once plus what is taken, not their product."""
    store = store_of(300)
    a, b = store.open_namespace(A), store.open_namespace(B)
    b_keys = put(store, b, 0, 100, now=0.0)         # b's blocks are the coldest
    put(store, a, 1000, 200, now=1.0)               # the tier is full; a holds 200 of 300
    looked = 0
    policy_of = type(store.drams[""]).policy

    class Counted:
        """The tier's order, each item its victim test is asked about counted."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def counted(self, allowed: Any) -> Any:
            def test(item: Any) -> bool:
                nonlocal looked
                looked += 1
                return bool(allowed(item))
            return test

        def pop_victim(self, allowed: Any) -> Any:
            return self.inner.pop_victim(self.counted(allowed))

        def pop_victims(self, allowed: Any, count: int, take: Any) -> Any:
            return self.inner.pop_victims(self.counted(allowed), count, take)

    monkeypatch.setattr(type(store.drams[""]), "policy",
                        lambda self, cls: Counted(policy_of(self, cls)))
    a_keys = put(store, a, 2000, 1, now=2.0)        # a's first victim: past b's 100
    looked_for_one = looked
    chain = chain_keys(a.id, list(range(3000 * 16, 3064 * 16)), 16)
    looked = 0
    r = store.reserve("a", a, chain, None, 3.0)     # 64 victims at once, all a's
    store.commit("a", r.id, 3.0)
    assert cached(b, b_keys) == 100 and cached(a, a_keys + chain) == 65
    assert looked_for_one >= 100
    assert looked <= 2 * (100 + 64), f"{looked} blocks looked at for 64 victims"
    store.check_invariants()


def test_a_reservation_of_held_keys_only_makes_no_room_and_is_never_refused() -> None:
    """Keys held in DRAM take no slot (``skip_held``), but the reservation still made room
    for 0 slots: a tenant holding more than its quota (a quota lowered under it, say)
    had one of its own blocks evicted, or was refused, for a request that needs none."""
    store = store_of(16, tenant_quota=4 * SLOT)
    a = store.open_namespace(A)
    keys = put(store, a, 0, 4, now=0.0)
    store.tenant_quota = 3 * SLOT                           # a holds one slot past it
    r = store.reserve("a", a, keys[:2], None, 1.0, skip_held=True)
    assert r.offsets == [] and cached(a, keys) == 4         # no block of a's went for it
    store.abort("a", r.id)
    r = store.reserve("a", a, keys, None, 2.0, skip_held=True)  # all pinned meanwhile
    assert r.offsets == [] and cached(a, keys) == 4
    store.abort("a", r.id)
    store.check_invariants()
