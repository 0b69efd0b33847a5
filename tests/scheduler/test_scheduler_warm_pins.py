"""Soft pins: warm items go last, in deadline order, and cool down on time."""

from __future__ import annotations

from kvstore.scheduler.eviction import LRUPolicy, S3FIFOPolicy, WarmPins


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _warm_lru(clock: _Clock, items: int) -> WarmPins[int]:
    policy: WarmPins[int] = WarmPins(LRUPolicy(), clock)
    for item in range(items):
        policy.insert(item)
    return policy


def test_warm_items_are_taken_last_earliest_deadline_first() -> None:
    clock = _Clock()
    policy = _warm_lru(clock, 4)
    policy.pin_soft(0, until=20.0)
    policy.pin_soft(1, until=10.0)
    assert len(policy) == 4
    assert [policy.pop_victim(lambda _: True) for _ in range(4)] == [2, 3, 1, 0]
    assert policy.pop_victim(lambda _: True) is None


def test_warmth_ends_at_the_deadline() -> None:
    clock = _Clock()
    policy = _warm_lru(clock, 3)
    policy.pin_soft(0, until=5.0)
    clock.now = 5.0
    # 0 is back in the LRU order as if just inserted: after 1 and 2.
    assert [policy.pop_victim(lambda _: True) for _ in range(3)] == [1, 2, 0]


def test_a_later_deadline_wins_and_unpin_soft_ends_it_now() -> None:
    clock = _Clock()
    policy = _warm_lru(clock, 2)
    policy.pin_soft(0, until=5.0)
    policy.pin_soft(0, until=2.0)  # earlier: ignored
    clock.now = 3.0
    assert policy.expire() == 0 and policy.is_warm(0)
    policy.unpin_soft(0)
    assert not policy.is_warm(0)
    assert [policy.pop_victim(lambda _: True) for _ in range(2)] == [1, 0]


def test_hard_pin_beats_warmth_and_warmth_outlives_it() -> None:
    clock = _Clock()
    policy = _warm_lru(clock, 2)
    policy.pin_soft(0, until=10.0)
    policy.pin(0)
    assert len(policy) == 1
    assert policy.pop_victim(lambda _: True) == 1
    assert policy.pop_victim(lambda _: True) is None
    policy.unpin(0)
    assert len(policy) == 1 and policy.is_warm(0)
    clock.now = 11.0
    policy.pin(0)
    assert policy.expire() == 1  # back in the order, still hard-pinned
    assert policy.pop_victim(lambda _: True) is None
    policy.unpin(0)
    assert policy.pop_victim(lambda _: True) == 0


def test_allowed_is_respected_among_warm_items_and_remove_forgets() -> None:
    clock = _Clock()
    policy: WarmPins[int] = WarmPins(S3FIFOPolicy(), clock)
    for item in range(3):
        policy.insert(item)
        policy.pin_soft(item, until=float(item))
    clock.now = -1.0
    assert policy.pop_victim(lambda item: item != 0) == 1
    policy.remove(2)
    assert len(policy) == 1 and list(policy.evictable()) == [0]
    assert "warm=1" in repr(policy)


def test_warming_the_same_items_again_and_again_keeps_the_heap_bounded() -> None:
    """Every later deadline pushes an entry; stale ones are dropped once they outnumber
    the warm items (a client warming 4096 blocks 1500 times grew a daemon by 600 MiB)."""
    clock = _Clock()
    policy = _warm_lru(clock, 100)
    for round_ in range(1, 500):
        for item in range(100):
            policy.pin_soft(item, until=float(round_))
        assert len(policy._deadlines) <= 2 * 100 + 64 + 1
    clock.now = 499.0  # every warmth ends once, at its last deadline
    assert policy.expire() == 100


def test_warm_victims_come_in_deadline_order_past_hard_pins_and_refusals() -> None:
    """Against the sort the choice was before, over random pins, re-pins, removals and
    refusals: the same victim every time."""
    import random

    rng = random.Random(7)
    for trial in range(30):
        clock = _Clock()
        n = 300
        policy = _warm_lru(clock, n)
        deadlines = rng.sample(range(1, 100_000), 3 * n)  # no ties: one order
        live = set(range(n))
        for item in range(n):
            if rng.random() < 0.8:
                policy.pin_soft(item, until=float(deadlines.pop()))
            if rng.random() < 0.3:
                policy.pin_soft(item, until=float(deadlines.pop()))  # later or not
            if rng.random() < 0.2:
                policy.pin(item)
        for item in rng.sample(range(n), 20):
            policy.remove(item)
            live.discard(item)
        refused = set(rng.sample(range(n), 40))
        while True:
            want = next((item for item, _ in sorted(policy._warm.items(), key=lambda kv: kv[1])
                         if item not in policy._hard and item not in refused), None)
            ordinary = [i for i in policy.inner.evictable() if i not in refused]
            victim = policy.pop_victim(lambda i: i not in refused)
            if ordinary:
                assert victim not in policy._warm
            else:
                assert victim == want, (trial, victim, want)
            if victim is None:
                break
            live.discard(victim)
