"""Eviction policies: LRU, ARC and SLRU against list models, every policy against the
interface's invariants and against the store's double report of a hit, and the
behaviour that makes S3-FIFO, ARC and SLRU scan-resistant."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.scheduler.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    ARCPolicy,
    AutoPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SLRUPolicy,
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
    for tick in range(10):
        policy.access("a")  # capped at 3: three passes spend it
        policy.pop_victim(lambda _: False)  # a tick, so that each hit counts
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


@pytest.mark.parametrize("name", ["arc", "slru"])
def test_items_hit_twice_survive_a_scan(name: str) -> None:
    policy = make_policy(name)
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


def test_s3fifo_counts_a_hit_once_per_tick() -> None:
    # lookup and acquire both report the same hit; only churn between hits makes two.
    once: S3FIFOPolicy[int] = S3FIFOPolicy(promote_threshold=2)
    twice: S3FIFOPolicy[int] = S3FIFOPolicy(promote_threshold=2)
    for policy in (once, twice):
        _fill(policy, range(3))
        policy.access(0)
    once.access(0)  # the same tick: the same reference
    twice.insert(3)  # churn: a new tick
    twice.access(0)
    assert once.pop_victim(lambda _: True) == 0  # one hit is below the threshold
    assert twice.pop_victim(lambda _: True) == 1  # two hits: 0 went to main


@pytest.mark.parametrize("name", sorted(FACTORIES))
@given(history=events)
@settings(max_examples=100, deadline=None)
def test_a_hit_reported_twice_counts_once(name: str, history: list[tuple[str, int, int]]) -> None:
    """The store's lookup and acquire both call access: victims must not change."""
    single, double = FACTORIES[name](), FACTORIES[name]()
    single_model, double_model = _Model(), _Model()
    for verb, item, mask in history:
        if verb == "pop":
            allowed = _allowed(mask)
            assert single.pop_victim(allowed) == double.pop_victim(allowed)
            continue
        _drive(single, single_model, verb, item, mask)
        _drive(double, double_model, verb, item, mask)
        if verb == "access" and item in double_model.present:
            double.access(item)
    assert list(single.evictable()) == list(double.evictable())


class _ListModel(Protocol):
    def apply(self, verb: str, item: int, mask: int) -> int | None: ...


def _check_against(policy: EvictionPolicy[int], reference: _ListModel,
                   history: list[tuple[str, int, int]], order: Callable[[], list[int]]) -> None:
    """Drive ``policy`` and its list model through ``history``: the same victims, and the
    same eviction order (``order()``) after every event."""
    model = _Model()
    for verb, item, mask in history:
        if verb == "pop":
            expected = reference.apply(verb, item, mask)
            assert policy.pop_victim(_allowed(mask)) == expected
            if expected is not None:
                model.present.discard(expected)
        else:
            if (verb == "insert" and item not in model.present) or (
                verb != "insert" and item in model.present
            ):
                reference.apply(verb, item, mask)
            _drive(policy, model, verb, item, mask)  # type: ignore[arg-type]
        assert list(policy.evictable()) == order()


class _ListARC:
    """ARC written plainly over lists (Megiddo and Modha's pseudo-code, with the
    store's pins and ``allowed``), the reference for ARCPolicy."""

    def __init__(self) -> None:
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.in_t2: dict[int, bool] = {}
        self.pinned: set[int] = set()
        self.p = 0.0
        self.c = 0  # the cache size: the most items tracked at once

    def apply(self, verb: str, item: int, mask: int) -> int | None:
        if verb == "insert" and item not in self.in_t2:
            size = max(1, self.c)
            if item in self.b1:
                self.p = min(float(size), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
                self.b1.remove(item)
                self.t2.append(item)
                self.in_t2[item] = True
            elif item in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
                self.b2.remove(item)
                self.t2.append(item)
                self.in_t2[item] = True
            else:
                self.t1.append(item)
                self.in_t2[item] = False
            self.c = max(self.c, len(self.in_t2))
        elif verb == "access" and item in self.in_t2:
            if item not in self.pinned:
                (self.t2 if self.in_t2[item] else self.t1).remove(item)
                self.t2.append(item)
            self.in_t2[item] = True
        elif verb == "pin" and item in self.in_t2 and item not in self.pinned:
            self.pinned.add(item)
            (self.t2 if self.in_t2[item] else self.t1).remove(item)
        elif verb == "unpin" and item in self.pinned:
            self.pinned.discard(item)
            (self.t2 if self.in_t2[item] else self.t1).append(item)
        elif verb == "remove" and item in self.in_t2:
            in_t2 = self.in_t2.pop(item)
            if item in self.pinned:
                self.pinned.discard(item)
            else:
                (self.t2 if in_t2 else self.t1).remove(item)
        elif verb == "pop":
            t1_first = len(self.t1) > self.p or not self.t2
            lists = [(self.t1, self.b1), (self.t2, self.b2)]
            for queue, ghost in lists if t1_first else lists[::-1]:
                for candidate in queue:
                    if mask >> candidate & 1:
                        queue.remove(candidate)
                        del self.in_t2[candidate]
                        ghost.append(candidate)
                        size = self.c
                        while self.b1 and len(self.t1) + len(self.b1) > size:
                            self.b1.pop(0)
                        while self.b2 and len(self.b1) + len(self.b2) > size:
                            self.b2.pop(0)
                        return candidate
        return None


@given(history=events)
@settings(max_examples=300, deadline=None)
def test_arc_matches_a_list_model(history: list[tuple[str, int, int]]) -> None:
    reference = _ListARC()
    _check_against(ARCPolicy(), reference, history, lambda: reference.t1 + reference.t2)


def test_default_policy_is_the_duel() -> None:
    assert DEFAULT_POLICY == "auto"
    assert isinstance(make_policy(DEFAULT_POLICY), AutoPolicy)


def test_a_batch_of_evictions_keeps_the_ghosts_of_a_full_cache() -> None:
    """The store evicts a reservation's victims before it inserts the new blocks, so the
    policy briefly tracks fewer items than the cache holds; ARC's ghost lists must still
    be sized by the full cache, or a victim that comes straight back is not recognised
    (and the next scan flushes it)."""
    policy = make_policy("arc")
    for i in range(10):
        policy.insert(i)
    victims = [policy.pop_victim(lambda _: True) for _ in range(5)]
    assert victims == [0, 1, 2, 3, 4]
    for v in victims:
        policy.insert(v)                      # back at once: a ghost hit for each
    for i in range(100, 110):
        policy.insert(i)                      # a scan of ten new items
    taken = [policy.pop_victim(lambda _: True) for _ in range(10)]
    assert set(taken).isdisjoint(victims), taken


class _ListSLRU:
    """Adaptive segmented LRU written plainly over lists, the reference for SLRUPolicy
    (ghost of at most 2x the cache size, recent window 0.25x, skip 3 here)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.probation: list[int] = []
        self.protected: list[int] = []
        self.segment: dict[int, bool] = {}  # item -> protected?
        self.pinned: set[int] = set()
        self.ghost: list[tuple[int, bool, int]] = []  # (item, from protected, count then)
        self.evicted = {False: 0, True: 0}
        self.c = 0
        self.target = 0.0

    def _queue(self, item: int) -> list[int]:
        return self.protected if self.segment[item] else self.probation

    def apply(self, verb: str, item: int, mask: int) -> int | None:
        if verb == "insert" and item not in self.segment:
            hit = next((g for g in self.ghost if g[0] == item), None)
            self.segment[item] = hit is not None
            self.c = max(self.c, len(self.segment))
            if hit is not None:
                self.ghost.remove(hit)
                _, from_protected, then = hit
                if self.evicted[from_protected] - then < 0.25 * self.c:
                    self.target += -1.0 if from_protected else 1.0
                    self.target = min(max(self.target, 0.0), float(self.c))
            self._queue(item).append(item)
        elif verb == "access" and item in self.segment:
            if item not in self.pinned:
                self._queue(item).remove(item)
                self.protected.append(item)
            self.segment[item] = True
        elif verb == "pin" and item in self.segment and item not in self.pinned:
            self.pinned.add(item)
            self._queue(item).remove(item)
        elif verb == "unpin" and item in self.pinned:
            self.pinned.discard(item)
            self._queue(item).append(item)
        elif verb == "remove" and item in self.segment:
            if item in self.pinned:
                self.pinned.discard(item)
            else:
                self._queue(item).remove(item)
            del self.segment[item]
        elif verb == "pop":
            cold_first = len(self.probation) > self.target or not self.protected
            first, second = ((self.probation, self.protected) if cold_first
                             else (self.protected, self.probation))
            for queue, scan in ((first, first[:self.skip]), (second, second), (first, first)):
                for candidate in list(scan):
                    if mask >> candidate & 1:
                        queue.remove(candidate)
                        from_protected = self.segment.pop(candidate)
                        self.evicted[from_protected] += 1
                        self.ghost.append((candidate, from_protected,
                                           self.evicted[from_protected]))
                        while len(self.ghost) > 2 * self.c:
                            self.ghost.pop(0)
                        return candidate
        return None


@given(history=events)
@settings(max_examples=300, deadline=None)
def test_slru_matches_a_list_model(history: list[tuple[str, int, int]]) -> None:
    reference = _ListSLRU(skip=3)
    _check_against(SLRUPolicy(skip=3), reference, history,
                   lambda: reference.probation + reference.protected)


def test_slru_moves_its_target_on_recent_ghost_hits_only() -> None:
    policy: SLRUPolicy[int] = SLRUPolicy(window=0.25)
    _fill(policy, range(8))                  # cache size 8: "recent" is within 2 evictions
    assert policy.pop_victim(lambda _: True) == 0
    policy.insert(0)                         # back at once: probation was too small
    assert "target=1.0" in repr(policy)
    assert policy.pop_victim(lambda _: True) == 1
    for _ in range(3):                       # three more evictions from probation
        policy.pop_victim(lambda item: item != 0)
    policy.insert(1)                         # back, but long after: says nothing
    assert "target=1.0" in repr(policy)


def test_slru_passes_over_a_few_blocked_items_then_tries_the_other_segment() -> None:
    policy: SLRUPolicy[int] = SLRUPolicy(skip=2)
    _fill(policy, range(6))
    policy.access(5)                         # 5 is protected; 0..4 on probation
    # probation first (above its target of 0); 0 and 1 may not go: after passing two,
    # the protected segment gives its victim rather than searching probation on
    assert policy.pop_victim(lambda item: item not in (0, 1)) == 5
    assert policy.pop_victim(lambda item: item not in (0, 1)) == 2  # then probation again
