from __future__ import annotations

import random

import pytest

from kvstore.errors import TooLargeError
from kvstore.pool import SlabPool


def test_allocation_is_all_or_nothing_and_slabs_return_when_empty() -> None:
    pool = SlabPool(capacity_bytes=4 * 4096, slab_bytes=2 * 4096, alignment=4096)
    cls = pool.class_for(3000)
    assert cls.slot_bytes == 4096 and cls.slots_per_slab == 2
    assert pool.allocate(cls, 5) is None
    assert pool.empty_slabs == 2
    got = pool.allocate(cls, 3)
    assert got is not None and len(set(got)) == 3
    assert pool.empty_slabs == 0 and cls.free_slots == 1
    pool.check()
    pool.free(cls, got[:2])
    pool.check()
    pool.free(cls, got[2:])
    assert pool.empty_slabs == 2 and cls.free_slots == 0
    pool.check()


def test_size_classes_share_the_tier_by_slabs() -> None:
    pool = SlabPool(capacity_bytes=1 << 20, slab_bytes=1 << 18)
    small, big = pool.class_for(1000), pool.class_for(100_000)
    a = pool.allocate(small, 10)
    b = pool.allocate(big, 2)
    assert a and b and pool.empty_slabs == 2
    assert {o // pool.slab_bytes for o in a}.isdisjoint({o // pool.slab_bytes for o in b})
    assert pool.tail_waste_bytes() == (pool.slab_bytes % small.slot_bytes
                                       + pool.slab_bytes % big.slot_bytes)
    pool.check()


def test_a_block_larger_than_a_slab_is_refused() -> None:
    pool = SlabPool(capacity_bytes=1 << 20, slab_bytes=1 << 16)
    with pytest.raises(TooLargeError):
        pool.class_for(1 << 17)


def test_claim_rebuilds_exactly_the_slots_named() -> None:
    pool = SlabPool(capacity_bytes=8 * 4096, slab_bytes=4 * 4096, alignment=4096)
    cls = pool.class_for(4096)
    assert pool.claim(cls, 2 * 4096)
    assert pool.claim(cls, 5 * 4096)
    assert not pool.claim(cls, 2 * 4096)          # taken
    assert not pool.claim(cls, 100)               # not a slot boundary
    assert not pool.claim(cls, 8 * 4096)          # past the end
    pool.check()
    got = pool.allocate(cls, 6)
    assert got is not None and sorted(got + [2 * 4096, 5 * 4096]) == [i * 4096 for i in range(8)]
    pool.check()


def test_claims_in_any_order_then_allocations_and_frees_keep_each_slot_once() -> None:
    import random

    pool = SlabPool(capacity_bytes=2 * 64 * 4096, slab_bytes=64 * 4096, alignment=4096)
    cls = pool.class_for(4096)
    every = [i * 4096 for i in range(128)]
    claimed = random.Random(7).sample(every, 90)  # out of order, as a warm restart finds them
    for offset in claimed:
        assert pool.claim(cls, offset)
    for offset in claimed[::9]:
        assert not pool.claim(cls, offset)       # taken already
    pool.check()
    assert cls.free_slots == 128 - 90
    got = pool.allocate(cls, 128 - 90)
    assert got is not None and sorted(got + claimed) == every  # no slot handed out twice
    assert pool.allocate(cls, 1) is None
    pool.free(cls, claimed[:10])
    assert pool.claim(cls, claimed[0])           # freed again: claimable again
    assert not pool.claim(cls, got[0])
    pool.check()
    again = pool.allocate(cls, 9)
    assert again is not None and sorted(again) == sorted(claimed[1:10])
    pool.check()


def test_claiming_in_bulk_ends_as_claiming_one_by_one() -> None:
    rng = random.Random(11)
    one, bulk = SlabPool(64 * 4096, 16 * 4096, 4096), SlabPool(64 * 4096, 16 * 4096, 4096)
    c1, c2 = one.class_for(4096), bulk.class_for(4096)
    assert one.claim(c1, 3 * 4096) and bulk.claim(c2, 3 * 4096)  # a slab in use before
    offsets = rng.sample(range(0, 64 * 4096, 4096), 40) + [3 * 4096, 100, 64 * 4096, -4096,
                                                           2**70, -(2**70)]
    offsets += offsets[:5]  # claimed twice: the second fails
    rng.shuffle(offsets)
    one_by_one = [one.claim(c1, o) for o in offsets]
    assert bulk.claim_many(c2, offsets) == one_by_one
    assert sorted(bulk.free_offsets(c2)) == sorted(one.free_offsets(c1))
    assert c2.free_slots == c1.free_slots and bulk.empty_slabs == one.empty_slabs
    bulk.check()
    claimed = {3 * 4096} | {o for o, ok in zip(offsets, one_by_one) if ok}
    got = bulk.allocate(c2, bulk.available(c2))
    assert got == one.allocate(c1, one.available(c1))  # the same slots in the same order
    assert got is not None and len(got) == len(set(got)) == 64 - len(claimed)
    assert set(got) | claimed == set(range(0, 64 * 4096, 4096))  # each slot once
    bulk.check()
