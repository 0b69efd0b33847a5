"""Eviction policies: LRU against a list model, every policy against the interface's
invariants, and the behaviour that makes S3-FIFO and ARC scan-resistant."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.scheduler.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    WarmPins,
    make_policy,
)

ITEMS = range(12)

# One event: (verb, item, allowed-mask for pop).  Events that break the store's
# contract for the current state (insert of a present item, unpin of an unpinned one)
# are skipped by the drivers, so every sequence is a valid history.
events = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "pin", "unpin", "remove", "pop"]),
        st.sampled_from(ITEMS),
        st.integers(0, 2 ** len(ITEMS) - 1),
    ),
    max_size=120,
)


def _allowed(mask: int) -> Callable[[Hashable], bool]:
    return lambda item: bool(mask >> int(item) & 1)  # type: ignore[call-overload]


def _factories() -> dict[str, Callable[[], EvictionPolicy[Hashable]]]:
    factories = dict(POLICIES)
    factories["warm+s3fifo"] = lambda: WarmPins(S3FIFOPolicy(), clock=lambda: 0.0)
    factories["s3fifo-th2"] = lambda: S3FIFOPolicy(promote_threshold=2, ghost_ratio=3.0)
    return factories


FACTORIES = _factories()


class _Model:
    """What the store knows: which items are committed, and which are pinned."""

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.pinned: set[int] = set()

    @property
    def unpinned(self) -> set[int]:
        return self.present - self.pinned


def _drive(
    policy: EvictionPolicy[Hashable],
    model: _Model,
    verb: str,
    item: int,
    mask: int,
) -> None:
    """Apply one event to policy and model, checking what pop_victim may return."""
    if verb == "insert" and item not in model.present:
        model.present.add(item)
        policy.insert(item)
    elif verb == "access" and item in model.present:
        policy.access(item)
    elif verb == "pin" and item in model.unpinned:
        model.pinned.add(item)
        policy.pin(item)
    elif verb == "unpin" and item in model.pinned:
        model.pinned.discard(item)
        policy.unpin(item)
    elif verb == "remove" and item in model.present:
        model.present.discard(item)
        model.pinned.discard(item)
        policy.remove(item)
    elif verb == "pop":
        allowed = _allowed(mask)
        candidates = {i for i in model.unpinned if allowed(i)}
        victim = policy.pop_victim(allowed)
        if candidates:
            assert victim in candidates, f"{victim} is not one of {candidates}"
            model.present.discard(victim)
        else:
            assert victim is None, f"returned {victim} with no candidate"


@pytest.mark.parametrize("name", sorted(FACTORIES))
@given(history=events)
@settings(max_examples=150, deadline=None)
def test_every_policy_keeps_the_interface_invariants(
    name: str, history: list[tuple[str, int, int]]
) -> None:
    policy = FACTORIES[name]()
    model = _Model()
    for verb, item, mask in history:
        _drive(policy, model, verb, item, mask)
        assert len(policy) == len(model.unpinned)
        assert set(policy.evictable()) == model.unpinned
    # Once unpinned, everything can be taken, each item exactly once.
    for item in sorted(model.pinned):
        policy.unpin(item)
    drained = []
    while (victim := policy.pop_victim(lambda _: True)) is not None:
        drained.append(victim)
    assert sorted(drained) == sorted(model.present)  # type: ignore[type-var]
    assert len(policy) == 0


class _ListLRU:
    """The obvious LRU: a list, coldest first; pinned items leave it."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def apply(self, model: _Model, verb: str, item: int, mask: int) -> int | None:
        if verb == "insert" and item not in model.present:
            self.order.append(item)
        elif verb == "access" and item in model.unpinned:
            self.order.remove(item)
            self.order.append(item)
        elif verb == "pin" and item in model.unpinned:
            self.order.remove(item)
        elif verb == "unpin" and item in model.pinned:
            self.order.append(item)
        elif verb == "remove" and item in model.present and item not in model.pinned:
            self.order.remove(item)
        elif verb == "pop":
            for candidate in self.order:
                if mask >> candidate & 1:
                    self.order.remove(candidate)
                    return candidate
        return None


@given(history=events)
@settings(max_examples=300, deadline=None)
def test_lru_matches_a_list_model(history: list[tuple[str, int, int]]) -> None:
    policy: LRUPolicy[int] = LRUPolicy()
    reference = _ListLRU()
    model = _Model()
    for verb, item, mask in history:
        expected = reference.apply(model, verb, item, mask)
        if verb == "pop":
            assert policy.pop_victim(_allowed(mask)) == expected
            if expected is not None:
                model.present.discard(expected)
        else:
            _drive(policy, model, verb, item, mask)  # type: ignore[arg-type]
        assert list(policy.evictable()) == reference.order


def test_make_policy_knows_every_name_and_refuses_others() -> None:
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_policy("mru")


def _fill(policy: EvictionPolicy[int] | EvictionPolicy[Hashable], items: range) -> None:
    for item in items:
        policy.insert(item)


def test_s3fifo_skips_a_disallowed_item_and_keeps_its_place() -> None:
    policy: S3FIFOPolicy[int] = S3FIFOPolicy()
    _fill(policy, range(3))
    assert policy.pop_victim(lambda item: item != 0) == 1
    assert policy.pop_victim(lambda item: True) == 0  # still at the head
    assert policy.pop_victim(lambda item: True) == 2


def test_s3fifo_hit_items_survive_a_scan() -> None:
    policy: S3FIFOPolicy[int] = S3FIFOPolicy()
    hot = range(10)
    _fill(policy, hot)
    for item in hot:
        policy.access(item)
    capacity = 20
    # A long scan of one-time items through a cache of 20: each insert evicts one.
    for item in range(100, 400):
        if len(policy) >= capacity:
            assert policy.pop_victim(lambda _: True) not in hot
        policy.insert(item)
    assert set(hot) <= set(policy.evictable())


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy: S3FIFOPolicy[int] = S3FIFOPolicy()
    _fill(policy, range(10))
    assert policy.pop_victim(lambda _: True) == 0  # cold: evicted from small to the ghost
    policy.insert(0)  # seen again: straight to main
    # Small is over its share, so victims come from it; 0 outlives all of them.
    taken = [policy.pop_victim(lambda _: True) for _ in range(9)]
    assert taken == list(range(1, 10))
    assert list(policy.evictable()) == [0]


def test_s3fifo_frequency_is_capped_and_spent_in_main() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(max_freq=3)
    policy.insert("a")
    policy.pop_victim(lambda _: True)
    policy.insert("a")  # in main via the ghost
    policy.insert("b")
    policy.pop_victim(lambda _: True)
    policy.insert("b")  # main now holds a, b in that order
    for _ in range(10):
        policy.access("a")  # capped at 3: three passes spend it
    assert policy.pop_victim(lambda _: True) == "b"
    assert policy.pop_victim(lambda _: True) == "a"


def test_s3fifo_pinned_item_is_never_a_victim_and_rejoins_on_unpin() -> None:
    policy: S3FIFOPolicy[int] = S3FIFOPolicy()
    _fill(policy, range(3))
    policy.pin(0)
    assert len(policy) == 2
    assert policy.pop_victim(lambda _: True) == 1
    assert policy.pop_victim(lambda _: True) == 2
    assert policy.pop_victim(lambda _: True) is None
    policy.unpin(0)
    assert policy.pop_victim(lambda _: True) == 0


def test_arc_prefers_items_hit_twice_over_a_scan() -> None:
    policy: ARCPolicy[int] = ARCPolicy()
    hot = range(5)
    _fill(policy, hot)
    for item in hot:
        policy.access(item)
    for item in range(100, 200):
        if len(policy) >= 15:
            assert policy.pop_victim(lambda _: True) not in hot
        policy.insert(item)
    assert set(hot) <= set(policy.evictable())


def test_policies_repr_shows_counts() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        _fill(policy, range(4))
        policy.pin(1)
        assert "pinned=1" in repr(policy)
