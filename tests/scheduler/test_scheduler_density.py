"""The hit-density policy: its age buckets, LRU before it has learned, what it learns
from hits and ghosts, and that it keeps reused blocks through traffic LRU loses them to.

The interface's invariants (victims only evictable, allowed items; pins; double
reports) are checked for every registered policy, this one included, in
test_scheduler_eviction.py."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Hashable
from pathlib import Path
from types import ModuleType

import pytest

from kvstore.scheduler.density import HitDensityPolicy, age_bucket
from kvstore.scheduler.eviction import POLICIES, LRUPolicy


def _load_replay_sim() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "replay_sim.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_replay_sim_d", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _everything(item: Hashable) -> bool:
    return True


def test_age_buckets_are_exact_then_four_per_octave_and_never_go_back() -> None:
    assert [age_bucket(a) for a in range(8)] == list(range(8))
    assert age_bucket(8) == age_bucket(9) == 8 and age_bucket(10) == 9
    assert age_bucket(16) == age_bucket(19) == 12 and age_bucket(20) == 13
    buckets = [age_bucket(a) for a in range(1 << 16)]
    assert buckets == sorted(buckets)
    assert age_bucket(1 << 40) == age_bucket(1 << 50)  # the last bucket takes the rest


def test_before_it_has_learned_it_evicts_least_recently_used_first() -> None:
    density: HitDensityPolicy[int] = HitDensityPolicy(refresh=10_000)
    lru: LRUPolicy[int] = LRUPolicy()
    for policy in (density, lru):
        policy.insert_many(range(20))
        policy.access_many([3, 7, 11])
    order = [density.pop_victim(_everything) for _ in range(20)]
    assert order == [lru.pop_victim(_everything) for _ in range(20)]
    assert density.refreshes == 0


def test_a_hit_reported_twice_in_one_tick_is_learned_once() -> None:
    policy: HitDensityPolicy[int] = HitDensityPolicy()
    policy.insert_many(range(4))
    policy.access(2)
    policy.access(2)  # the store's acquire after its lookup
    assert sum(map(sum, policy._hits)) == 1.0
    policy.insert(9)  # the clock ticks: the next hit counts
    policy.access(2)
    assert sum(map(sum, policy._hits)) == 2.0


def test_a_key_back_from_the_ghost_history_is_learned_as_a_late_hit() -> None:
    policy: HitDensityPolicy[int] = HitDensityPolicy()
    policy.insert_many(range(8))
    assert policy.pop_victim(lambda item: item == 5) == 5
    assert "ghost=1" in repr(policy)
    policy.insert(5)
    assert "ghost=0" in repr(policy)
    assert sum(map(sum, policy._hits)) == 1.0  # the hit it would have had
    assert "classes=7/1/" in repr(policy)  # and it starts again as a block hit once


def test_a_ghost_not_back_within_its_horizon_is_learned_as_an_eviction() -> None:
    policy: HitDensityPolicy[int] = HitDensityPolicy(ghost=1.0)
    policy.insert_many(range(4))
    for item in range(4, 40):  # a cache of 4: each insert evicts one, ghosts overflow
        assert policy.pop_victim(_everything) is not None
        policy.insert(item)
    assert sum(map(sum, policy._evictions)) > 0
    assert len(policy._ghost) <= 4


def test_it_passes_over_refused_blocks_and_falls_back_to_any_allowed_one() -> None:
    policy: HitDensityPolicy[int] = HitDensityPolicy(skip=2)
    policy.insert_many(range(10))
    assert policy.pop_victim(lambda item: item == 9) == 9  # past skip: the fallback
    assert policy.pop_victim(lambda item: item == 1) == 1
    assert policy.pop_victim(lambda item: False) is None
    assert len(policy) == 8


def _densities_by_loop(hits: list[list[float]], evictions: list[list[float]],
                       ages: list[float], starts: list[float]) -> list[list[float]]:
    """The densities as the module docstring defines them, summed bucket by bucket from
    the oldest down: what the refresh's arrays must reproduce to the last bit."""
    tables = []
    for hit_row, eviction_row in zip(hits, evictions):
        table = [0.0] * len(hit_row)
        hits_above = events_above = age_sum_above = 0.0
        for bucket in range(len(hit_row) - 1, -1, -1):
            events = hit_row[bucket] + eviction_row[bucket]
            hits_above += hit_row[bucket]
            events_above += events
            age_sum_above += events * ages[bucket]
            lifetime = age_sum_above - starts[bucket] * events_above
            table[bucket] = hits_above / lifetime if events_above else 0.0
        tables.append(table)
    return tables


def test_a_refresh_learns_the_same_floats_as_the_sums_bucket_by_bucket() -> None:
    import random

    from kvstore.scheduler import density as module

    rng = random.Random(7)
    policy: HitDensityPolicy[int] = HitDensityPolicy(keep=0.8)
    for klass in range(5):
        for bucket in rng.sample(range(112), 40):  # empty buckets (and classes) too
            policy._hits[klass][bucket] = rng.random() * 10 ** rng.randint(-3, 4)
            policy._evictions[klass][bucket] = rng.choice((0.0, rng.random() * 50))
    hits = [list(row) for row in policy._hits]
    evictions = [list(row) for row in policy._evictions]
    policy._learn()
    decayed = [list(row) for row in policy._hits], [list(row) for row in policy._evictions]
    # counted after the refresh, before its densities are first asked for (the next
    # eviction): not in them
    policy._hits[0][3] += 2.0
    policy._evictions[4][100] += 1.0
    assert policy._density is not None
    expected = _densities_by_loop(hits, evictions, module._AGES, module._STARTS)
    assert [list(row) for row in policy._density] == expected
    assert any(value > 0.0 for row in expected for value in row)
    # ... and the histograms decayed by ``keep``, in place
    assert decayed == ([[h * 0.8 for h in row] for row in hits],
                       [[e * 0.8 for e in row] for row in evictions])
    # ... and a second refresh learns the counts it found
    hits = [list(row) for row in policy._hits]
    evictions = [list(row) for row in policy._evictions]
    policy._learn()
    assert [list(row) for row in policy._density] == _densities_by_loop(
        hits, evictions, module._AGES, module._STARTS)


def test_refuses_bad_parameters() -> None:
    for bad in ({"refresh": 0}, {"keep": 1.0}, {"ghost": 0.0}, {"skip": 0}):
        with pytest.raises(ValueError):
            HitDensityPolicy(**bad)  # type: ignore[arg-type]


def _hot_set_and_one_time_stream(policy_name: str) -> int:
    """Hits of a cache of 100 items: 60 hot items each asked for every 200 references,
    between them items asked for once (a scan)."""
    policy = POLICIES[policy_name]()
    present: set[int] = set()
    hits = 0
    one_time = 1000
    for step in range(40_000):
        item = step // 3 % 60 if step % 3 == 0 else (one_time := one_time + 1)
        if item in present:
            hits += 1
            policy.access(item)
            continue
        if len(present) >= 100:
            victim = policy.pop_victim(_everything)
            assert victim is not None
            present.discard(victim)  # type: ignore[arg-type]
        present.add(item)
        policy.insert(item)
    return hits


def test_it_learns_to_keep_a_reused_set_that_a_scan_flushes_from_lru() -> None:
    lru = _hot_set_and_one_time_stream("lru")
    density = _hot_set_and_one_time_stream("density")
    assert lru == 0  # each hot item comes back after 120 one-time items: LRU lost it
    assert density > 0.8 * 40_000 / 3  # nearly every hot reference hits


def test_it_beats_lru_on_a_scan_workload_in_the_prefix_cache_simulator() -> None:
    sim = _load_replay_sim()
    trace = sim.cacheable(sim.synthetic("scan", 1500))
    capacity = round(0.05 * sim.unique_blocks(trace))
    lru = sim.replay(trace, sim.PolicyCache(POLICIES["lru"](), capacity))
    density = sim.replay(trace, sim.PolicyCache(POLICIES["density"](), capacity, touches=2))
    assert density.hit_blocks > 1.1 * lru.hit_blocks


class _Node:
    __slots__ = ("name", "parent")

    def __init__(self, name: str, parent: _Node | None = None) -> None:
        self.name = name
        self.parent = parent


def test_a_chain_goes_tail_first_and_a_parent_is_not_even_offered_to_the_store() -> None:
    policy: HitDensityPolicy[_Node] = HitDensityPolicy()
    head = _Node("head")
    policy.insert(head)
    tail = _Node("tail", head)
    policy.insert(tail)  # younger than its head
    asked: list[str] = []

    def allowed(node: _Node) -> bool:
        asked.append(node.name)
        return True

    assert policy.pop_victim(allowed) is tail
    assert asked == ["tail"]
    assert policy.pop_victim(allowed) is head  # its last child gone: a leaf again
    assert len(policy) == 0


def test_it_lists_its_items_least_recently_referenced_first() -> None:
    """It listed them in the order they first came, whatever their hits since: a
    hand-over to LRU then evicted the most recently hit first."""
    policy: HitDensityPolicy[int] = HitDensityPolicy()
    policy.parent_of = lambda item: None
    policy.insert_many(range(6))
    policy.access_many([4, 0, 2])
    policy.pin(5)
    policy.unpin(5)  # back in its queue, its last reference as it was
    policy.pin(3)
    assert list(policy.evictable()) == [1, 5, 4, 0, 2]
