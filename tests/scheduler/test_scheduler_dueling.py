"""The duel of eviction orders (``auto``): it follows the candidate whose miniature cache
hits most, falls back to LRU where nothing else pays, and a candidate that forgets
another's victim is left as if it had chosen it."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc
from collections.abc import Callable, Hashable
from operator import attrgetter
from pathlib import Path

import pytest

from kvstore.scheduler.density import HitDensityPolicy, age_bucket
from kvstore.scheduler import dueling
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.eviction import (
    ARCPolicy,
    AutoPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SLRUPolicy,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_sim  # noqa: E402  (benchmarks/ is no package)

ORDERS: dict[str, Callable[[], EvictionPolicy[Hashable]]] = {
    "lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "arc": ARCPolicy, "slru": SLRUPolicy,
}


def _request(ids: list[int]) -> replay_sim.TraceRequest:
    return replay_sim.TraceRequest(0, len(ids) * 512, 1, ids)


def _hits(trace: list[replay_sim.TraceRequest], policy: EvictionPolicy[Hashable],
          capacity: int) -> int:
    return replay_sim.replay(trace, replay_sim.PolicyCache(policy, capacity)).hit_blocks


def _hot_and_scans(seed: int, requests: int) -> list[replay_sim.TraceRequest]:
    """Single-block requests: a hot set of 60 asked for over and over, between runs of
    one-time blocks (a scan LRU lets flush the hot set, SLRU and ARC do not)."""
    rng = random.Random(seed)
    trace = []
    fresh = 10_000
    for _ in range(requests):
        if rng.random() < 0.5:
            trace.append(_request([rng.randrange(60)]))
        else:
            trace.append(_request([fresh]))
            fresh += 1
    return trace


def _drift(seed: int, requests: int) -> list[replay_sim.TraceRequest]:
    """Single blocks drawn from a window of 80 that slides on: what was asked for lately
    is asked for again, what fell out of the window never is (recency is everything)."""
    rng = random.Random(seed)
    return [_request([i // 4 + rng.randrange(80)]) for i in range(requests)]


def test_the_duel_follows_a_scan_resistant_order_on_scans() -> None:
    trace = _hot_and_scans(seed=1, requests=30_000)
    auto = AutoPolicy(epoch=512)
    hits = {name: _hits(trace, make(), 100) for name, make in ORDERS.items()}
    got = _hits(trace, auto, 100)
    assert auto.leader in ("slru", "arc"), auto
    assert got > 1.1 * hits["lru"], (got, hits)
    assert got >= 0.95 * max(hits["slru"], hits["arc"]), (got, hits)


def test_the_duel_keeps_lru_where_nothing_beats_it() -> None:
    trace = _drift(seed=2, requests=20_000)
    auto = AutoPolicy(epoch=512)
    got = _hits(trace, auto, 100)
    lru = _hits(trace, LRUPolicy(), 100)
    assert auto.leader == "lru" and auto.switches == 0, auto
    assert got == lru


def test_a_hand_over_keeps_every_item_in_its_order_and_pins() -> None:
    duel = Duel([LRUPolicy, SLRUPolicy])
    for item in range(6):
        duel.insert(item)
    duel.access(0)
    duel.pin(1)
    assert duel.pop_victim(lambda _: True) == 2  # LRU's coldest, 0 was hit and 1 pinned
    duel._take_over(1)
    assert duel.leader == "slru" and duel.switches == 1
    assert sorted(duel.evictable()) == [0, 3, 4, 5] and len(duel) == 4
    assert duel.pop_victim(lambda _: True) == 3  # the old order's coldest goes first
    duel.unpin(1)  # still pinned in the new order until now
    assert sorted(duel.evictable()) == [0, 1, 4, 5]
    duel.remove(4)
    assert len(duel) == 3 and "pinned=0" in repr(duel)


def test_a_hand_over_passes_the_latest_victims_as_ghosts() -> None:
    """An SLRU handed a cache that LRU let a scan flush knows the hot keys coming back
    as its own ghosts (protected at once), but as old ones: its target stays."""
    duel = Duel([LRUPolicy, SLRUPolicy])
    duel.insert_many(range(4))
    assert [duel.pop_victim(lambda _: True) for _ in range(2)] == [0, 1]
    duel.insert_many(range(10, 14))  # the cache grew: the victims' memory with it
    assert [duel.pop_victim(lambda _: True) for _ in range(5)] == [2, 3, 10, 11, 12]
    duel._take_over(1)
    order = duel._order
    assert isinstance(order, SLRUPolicy)
    target = order._target
    duel.insert_many([1, 11, 99])  # two victims back, one key never seen
    assert sorted(order._protected) == [1, 11] and list(order._probation) == [13, 99]
    assert order._target == target
    assert duel._gone.maxlen == 16  # a power of two at least twice the cache's 6


def test_a_hand_over_passes_victims_from_further_back_than_the_cache_holds() -> None:
    """SLRU keeps ghosts of twice the cache: handed over late, it knows a hot key that
    more victims than the cache holds followed out, and protects it when it comes back
    (given only the cache's size of names, it took it as new, on probation)."""
    duel = Duel([LRUPolicy, SLRUPolicy])
    duel.insert_many(range(4))
    assert duel.pop_victim(lambda _: True) == 0  # the hot key, flushed
    victims = []
    for key in range(10, 15):
        duel.insert(key)
        victims.append(duel.pop_victim(lambda _: True))
    assert victims == [1, 2, 3, 10, 11]  # six victims in all, the cache holds four
    duel._take_over(1)
    order = duel._order
    assert isinstance(order, SLRUPolicy)
    duel.insert(0)
    assert list(order._protected) == [0] and 0 not in order._probation


def test_a_hand_over_passes_no_cached_block_as_a_ghost_and_each_victim_once() -> None:
    """A victim cached again since is no ghost of the new order, and one evicted twice
    is handed over once, at its latest eviction (the newest ghost, trimmed last)."""
    duel = Duel([LRUPolicy, SLRUPolicy])
    duel.insert_many(range(4))
    assert duel.pop_victim(lambda _: True) == 0
    duel.insert(0)  # back: resident again
    assert duel.pop_victim(lambda _: True) == 1
    assert duel.pop_victim(lambda _: True) == 2
    duel.insert(2)
    assert duel.pop_victim(lambda _: True) == 3
    duel.insert(3)
    assert duel.pop_victim(lambda _: True) == 0  # evicted again: its latest place
    duel._take_over(1)
    order = duel._order
    assert isinstance(order, SLRUPolicy)
    assert 2 not in order._ghost and 3 not in order._ghost  # cached again
    assert list(order._ghost._order) == [1, 0]  # 0 once, the newest


def test_a_hand_over_protects_what_came_back_since_its_eviction() -> None:
    """A block that LRU evicted and a miss brought back is a ghost hit to the new order:
    SLRU takes it into its protected segment, where it outlives blocks seen once since
    (taken as new, it went before them, as LRU has it); a block never evicted is not."""
    duel = Duel([LRUPolicy, SLRUPolicy])
    duel.insert_many(range(4))
    assert duel.pop_victim(lambda _: True) == 0
    duel.insert(0)  # back after its eviction
    duel.insert_many([4, 5])
    assert list(duel.evictable()) == [1, 2, 3, 0, 4, 5]
    duel._take_over(1)
    order = duel._order
    assert isinstance(order, SLRUPolicy)
    assert list(order._protected) == [0] and list(order._probation) == [1, 2, 3, 4, 5]
    victims = [duel.pop_victim(lambda _: True) for _ in range(6)]
    assert victims == [1, 2, 3, 4, 5, 0], victims


def test_the_victims_names_are_bounded_and_copied_once_per_doubling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The names kept for a hand-over stay at most RECALL_MOST however large the
    cache, and growing by one item at a time does not copy them at every eviction."""
    monkeypatch.setattr(dueling, "RECALL_MOST", 32)
    duel = Duel([LRUPolicy, SLRUPolicy])
    duel.insert_many(range(5))
    duel.pop_victim(lambda _: True)
    first = duel._gone
    assert first.maxlen == 16  # twice the cache's 5, to a power of two
    duel.insert_many([100, 101])  # the cache grows to 6, twice that still under 16: no copy
    duel.pop_victim(lambda _: True)
    assert duel._gone is first
    duel.insert_many(range(200, 300))  # far past RECALL_MOST
    for _ in range(50):
        duel.pop_victim(lambda _: True)
    assert duel._gone.maxlen == 32 and len(duel._gone) == 32


def test_the_duel_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        Duel([])
    with pytest.raises(ValueError):
        Duel([LRUPolicy], sample_shift=17)
    with pytest.raises(ValueError):
        Duel([LRUPolicy], keep=1.0)
    with pytest.raises(ValueError, match="most bounds 2 candidates"):
        Duel([LRUPolicy], most=(None, 10))  # an IndexError at the first election


def _phases(seed: int, requests: int) -> list[list[int]]:
    """Requests of several blocks, in phases that alternate between a hot set between
    scans (SLRU and ARC win) and a sliding window (LRU wins), so the duel hands over
    again and again, now and then in the middle of a request."""
    rng = random.Random(seed)
    fresh, out = 1000, []
    for n in range(requests):
        if (n // 400) % 2:
            out.append([100_000 + n // 2 + rng.randrange(80) for _ in range(rng.randrange(1, 12))])
        elif rng.random() < 0.5:
            out.append([rng.randrange(60) for _ in range(rng.randrange(1, 12))])
        else:
            out.append(list(range(fresh, fresh + rng.randrange(1, 9))))
            fresh += len(out[-1])
    return out


def test_batched_hits_match_one_call_per_item() -> None:
    """``access_many`` and ``insert_many`` (one call per lookup's hits, per commit's
    blocks, in runs to the candidate in charge) leave the duel as ``access`` and
    ``insert`` item by item would, hand-overs mid-batch included."""
    one, batched = AutoPolicy(sample_shift=1, epoch=16), AutoPolicy(sample_shift=1, epoch=16)
    cached: set[int] = set()
    victims: tuple[list[int | None], list[int | None]] = ([], [])
    for ids in _phases(seed=3, requests=6000):
        hits = [i for i in ids if i in cached]
        misses = list(dict.fromkeys(i for i in ids if i not in cached))
        for i in hits:
            one.access(i)
        batched.access_many(hits)
        for i in misses:
            one.insert(i)
        batched.insert_many(misses)
        cached.update(misses)
        while len(cached) > 100:
            victims[0].append(one.pop_victim(lambda _: True))
            victims[1].append(batched.pop_victim(lambda _: True))
            cached.discard(victims[0][-1])  # type: ignore[arg-type]
        if len(cached) % 7 == 0 and cached:  # a removal now and then
            gone = min(cached)
            one.remove(gone)
            batched.remove(gone)
            cached.discard(gone)
    assert one.switches > 10, "the phases should make the duel hand over again and again"
    assert victims[0] == victims[1]
    assert (one.leader, one.switches, one.scores()) == \
        (batched.leader, batched.switches, batched.scores())
    assert list(one.evictable()) == list(batched.evictable())
    # the sample is decided once per item, and forgotten with it
    sampled = {k for k in batched._items if not ((k * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 63}
    assert {k for k, state in batched._items.items() if type(state) is int} == sampled
    assert all(state >> 1 == hash(k) for k, state in batched._items.items()
               if type(state) is int)


class _Block:
    """A store entry in miniature: a block cached again is a new object, same key."""

    __slots__ = ("key", "parent")

    def __init__(self, key: bytes, parent: _Block | None = None) -> None:
        self.key = key
        self.parent = parent


def test_a_block_cached_again_is_the_same_key_to_the_miniatures_and_the_ghosts() -> None:
    duel = AutoPolicy(sample_shift=0)  # every key sampled
    duel.ghost_key = lambda block: block.key  # type: ignore[attr-defined]
    blocks = [_Block(bytes([i])) for i in range(4)]
    duel.insert_many(blocks)
    duel.remove(blocks[2])  # dropped from the cache; the miniatures still hold its key
    again = _Block(bytes([2]))
    duel.insert(again)
    # Each candidate's miniature counts the key's return as a hit (by object identity
    # it would be a new key and a miss, and a duel in the daemon would never learn
    # what the order in charge dropped).
    assert sum(duel.scores().values()) == len(duel.scores())
    order = duel._order
    assert order.ghost_key(again) == bytes([2])  # type: ignore[attr-defined]
    assert duel.pop_victim(lambda block: block is blocks[0]) is blocks[0]


def test_after_a_hand_over_the_new_order_names_its_ghosts_by_key() -> None:
    duel = AutoPolicy()
    duel.ghost_key = lambda block: block.key  # type: ignore[attr-defined]
    duel.insert_many([_Block(bytes([i])) for i in range(4)])
    duel._take_over(1)  # SLRU takes the order
    victim = duel.pop_victim(lambda block: True)
    assert isinstance(victim, _Block) and victim.key == bytes([0])
    duel.insert(_Block(bytes([0])))  # back from SLRU's ghost list: its protected segment
    assert "protected=1" in repr(duel._order), duel._order


def test_a_hand_over_hits_again_what_was_hit_since_it_entered() -> None:
    """A segmented order handed the items starts with its protected segment: an old
    item that was hit outlives newer ones that were not (cold, it went as LRU has it)."""
    duel = Duel([LRUPolicy, SLRUPolicy])
    for item in range(8):
        duel.insert(item)
        if item == 5:
            duel.access(0)
    duel.access(6)
    duel.remove(6)
    duel.insert(6)  # a removal forgets the item's hits: 6 is new again
    duel._take_over(1)
    victims = [duel.pop_victim(lambda _: True) for _ in range(7)]
    assert victims == [1, 2, 3, 4, 5, 7, 6], victims
    assert list(duel.evictable()) == [0]


def test_a_hand_over_takes_the_target_the_miniature_learned_at_scale() -> None:
    duel = Duel([LRUPolicy, SLRUPolicy, ARCPolicy], sample_shift=2)
    for item in range(40):  # the miniatures: caches of 40 >> 2 = 10 items
        duel.insert(item)
    slru, arc = duel._minis[1].order, duel._minis[2].order
    slru._target = 2.0  # type: ignore[attr-defined]
    arc._target_t1 = 1.5  # type: ignore[attr-defined]
    duel._take_over(1)
    assert "target=8.0" in repr(duel._order), duel._order
    duel._take_over(2)
    assert "target_t1=6.0" in repr(duel._order), duel._order


@pytest.mark.parametrize("make", [SLRUPolicy, ARCPolicy])
def test_an_adopted_target_changes_which_segment_gives_up_a_victim(
        make: Callable[[], EvictionPolicy[Hashable]]) -> None:
    learned, order = make(), make()
    order.insert_many(range(10))
    order.access_many([6, 7, 8, 9])  # the protected segment (T2), the rest on probation
    order.adopt_tuning(learned, 4.0)  # nothing learned yet: target 0, probation first
    assert order.pop_victim(lambda _: True) == 0
    for name in ("_target", "_target_t1"):
        if hasattr(learned, name):
            setattr(learned, name, 2.0)
    order.adopt_tuning(learned, 4.0)  # probation's target 8 > its 5 items: protected first
    assert order.pop_victim(lambda _: True) == 6
    order.adopt_tuning(LRUPolicy(), 4.0)  # another policy's settings are not its own
    assert order.pop_victim(lambda _: True) == 7


def test_the_miniatures_keep_a_sampled_key_only_while_one_holds_it() -> None:
    """A sampled key the miniatures all dropped is forgotten (its node goes, so their
    memory follows their size, not the traffic's), but not within the tick it was last
    referenced: a hit reported twice then still counts once."""
    # every key sampled; no hand-over
    duel = AutoPolicy(sample_shift=0, epoch=10**9, shortest=10**9)
    cached: list[int] = []
    rng = random.Random(7)
    for fresh in range(2000):
        duel.insert(fresh)
        cached.append(fresh)
        if len(cached) > 40:
            cached.remove(duel.pop_victim(lambda _: True))  # type: ignore[arg-type]
        hit = rng.choice(cached)
        duel.access(hit)
        duel.access(hit)  # lookup, then acquire: one reference
    nodes = list(duel._nodes.values())
    assert all(node.held or node in duel._lingering for node in nodes)
    assert len(nodes) <= 3 * 40 + len(duel._lingering)  # at most each miniature's own
    # the same count as a duel told each hit once
    once = AutoPolicy(sample_shift=0, epoch=10**9, shortest=10**9)
    cached, rng = [], random.Random(7)
    for fresh in range(2000):
        once.insert(fresh)
        cached.append(fresh)
        if len(cached) > 40:
            cached.remove(once.pop_victim(lambda _: True))  # type: ignore[arg-type]
        once.access(rng.choice(cached))
    assert once.scores() == duel.scores() and sum(duel.scores().values()) > 0


def test_a_released_duel_leaves_no_cycles_behind() -> None:
    """The miniatures' orders link their sampled keys' nodes (reference cycles, which
    the daemon's collector never walks once frozen): ``release`` unlinks them too, so a
    policy replaced by SIGHUP is freed by reference counting alone."""
    import gc

    from kvstore.scheduler.dueling import _Sampled

    def nodes() -> int:  # by type(): isinstance asks some objects (torch's) for more
        return sum(issubclass(type(o), _Sampled) for o in gc.get_objects())

    gc.collect()
    before = nodes()
    duel = AutoPolicy(sample_shift=0, epoch=10**9, shortest=10**9)
    cached: list[int] = []
    was = gc.isenabled()
    gc.disable()
    try:
        for fresh in range(3000):
            duel.insert(fresh)
            cached.append(fresh)
            if len(cached) > 200:
                cached.remove(duel.pop_victim(lambda _: True))  # type: ignore[arg-type]
        assert nodes() - before >= 200
        duel.release()
        del duel
        assert nodes() == before  # gone with the last reference, no collection run
    finally:
        if was:
            gc.enable()


def test_a_small_cache_elects_as_often_as_its_miniatures_turn_over() -> None:
    """Elections every 512 sampled references left a small cache under LRU for a long
    time on a scan (its miniatures of a few dozen keys had turned over many times); now
    one comes every time they hold as many references as keys, at least ``shortest``."""
    trace = _hot_and_scans(seed=3, requests=4_000)
    auto = AutoPolicy(sample_shift=1)  # miniatures of 50 keys: elections every 64
    cache = replay_sim.PolicyCache(auto, 100)
    switched_at = None
    for index, request in enumerate(trace):
        hits = cache.lookup(request.hash_ids)
        cache.insert(request.hash_ids, hits)
        if switched_at is None and auto.switches:
            switched_at = index
    assert switched_at is not None and switched_at < 512, (switched_at, auto)
    assert auto.epoch == 64 and auto.leader in ("slru", "arc", "density"), auto
    big = AutoPolicy()
    big.insert_many(range(16_000))  # miniatures of 2000 keys: the longest epoch, 512
    big._elect()
    assert big.epoch == 512


def test_a_shorter_epoch_forgets_as_much_per_reference() -> None:
    duel = Duel([LRUPolicy, SLRUPolicy], epoch=512, shortest=64)
    duel._minis[0].score = 100.0
    duel._sampled = 64  # one short epoch
    duel._elect()
    assert duel._minis[0].score == pytest.approx(100.0 * 0.9 ** (64 / 512))


def test_a_hand_over_to_hit_density_takes_its_miniatures_histograms_at_scale() -> None:
    duel = AutoPolicy(sample_shift=2)
    duel.parent_of = lambda item: item - 1 if item % 4 else None  # type: ignore[assignment]
    for item in range(40):
        duel.insert(item)
    mini = duel._minis[3].order
    assert isinstance(mini, HitDensityPolicy) and mini.refresh == 4096 >> 2
    mini._hits[0][age_bucket(10)] = 5.0  # never-hit blocks: hit again at age 10 ...
    mini._learn()  # (each refresh decays the histograms by 0.9: here, then at the hand-over)
    duel._take_over(3)
    order = duel._order
    assert isinstance(order, HitDensityPolicy) and order._density is not None
    # ... which is age 40 in a cache four times the size; the hand-over's own inserts
    # and hits are not learned
    assert order._hits[0][age_bucket(40)] == pytest.approx(5.0 * 0.9 * 0.9)
    assert sum(map(sum, order._hits)) == pytest.approx(5.0 * 0.9 * 0.9)
    assert order.parent_of(6) == 5 and order.parent_of(4) is None


class _Linked:
    """A store block in miniature: a key, no parent, one set of links."""

    __slots__ = ("key", "parent", "a_order", "a_older", "a_newer")

    def __init__(self, key: int) -> None:
        self.key = key
        self.parent = None
        self.a_order = self.a_older = self.a_newer = None


@pytest.mark.parametrize("pinned", [0, 1, 100])
def test_a_hand_over_allocates_no_table_of_every_item(pinned: int) -> None:
    """The item states were copied shard by shard into one dict for the hand-over: at
    millions of blocks, a spike of that size.  Now the states are read where they are;
    and the pinned items were found by a set of every listed one, once any was pinned
    (as some nearly always are): the duel keeps its pinned ones."""
    items = [_Linked(key) for key in range(50_000)]  # past a ShardedDict's split
    duel = AutoPolicy()
    duel.links = "a"
    duel.ghost_key = attrgetter("key")  # type: ignore[assignment]
    for start in range(0, len(items), 16):
        duel.insert_many(items[start:start + 16])
    duel.access_many(items[::3])
    for item in items[:pinned]:
        duel.pin(item)
    gc.collect()
    tracemalloc.start()
    try:
        duel._take_over(1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert duel.leader == "slru" and len(duel) == len(items) - pinned
    assert f"pinned={pinned}," in repr(duel)
    assert peak < sys.getsizeof(dict.fromkeys(items)), peak


def test_no_hand_over_while_the_cache_fills() -> None:
    duel = Duel([LRUPolicy, SLRUPolicy], sample_shift=0)
    duel.insert_many(range(10))
    duel._minis[1].hits = 100  # far ahead, but no victim was picked by anyone yet
    duel._elect()
    assert duel.leader == "lru" and duel.switches == 0
    assert duel.pop_victim(lambda _: True) == 0
    duel._elect()  # its score carried over: the first election since an eviction
    assert duel.leader == "slru" and duel.switches == 1


@pytest.mark.parametrize("most, leader", [(5, "lru"), (10, "slru")])
def test_a_candidate_is_not_elected_past_the_most_items_it_may_take(
        most: int, leader: str) -> None:
    duel = Duel([LRUPolicy, SLRUPolicy], sample_shift=0, most=(None, most))
    duel.insert_many(range(10))
    assert duel.pop_victim(lambda _: True) == 0
    duel._minis[1].hits = 100
    duel._elect()
    assert duel.leader == leader


def test_a_hand_over_from_hit_density_keeps_the_items_recency() -> None:
    """Hit density listed its items in the order they first came: LRU, handed them,
    evicted the most recently hit first."""
    duel = AutoPolicy()
    duel.parent_of = lambda item: None  # type: ignore[assignment]
    duel.insert_many(range(10))
    duel._take_over(3)
    assert duel.leader == "density"
    duel.access_many(range(9, -1, -1))  # 0 hit last
    duel.pin(5)
    duel._take_over(0)
    victims = []
    while (victim := duel.pop_victim(lambda _: True)) is not None:
        victims.append(victim)
    assert victims == [9, 8, 7, 6, 4, 3, 2, 1, 0]


def test_a_hand_over_to_hit_density_counts_the_children_of_pinned_parents() -> None:
    """The pinned items were inserted in a call of their own, after the rest: hit
    density links a child to its parent within one call, and counted none for them, so
    it offered the store parents it must refuse."""
    parents = {item: item - 1 if item % 2 else None for item in range(8)}  # chains of 2
    duel = AutoPolicy()
    duel.parent_of = parents.get  # type: ignore[assignment]
    duel.insert_many(range(8))
    heads = [0, 2, 4, 6]
    for head in heads:
        duel.pin(head)  # a reader holds each chain's first block
    duel._take_over(3)
    order = duel._order
    assert isinstance(order, HitDensityPolicy)
    assert [order._entries[head].kids for head in heads] == [1, 1, 1, 1]
    duel.access_many([1, 3, 5, 7])  # the tails hit: a class of their own
    for head in heads:
        duel.unpin(head)  # the oldest of theirs
    asked: list[int] = []

    def leaf(item: int) -> bool:
        asked.append(item)
        return all(parents[child] != item for child in duel._items.keys())

    assert duel.pop_victim(leaf) == 1
    assert asked == [1]  # the heads passed over without asking


def test_a_leader_over_its_bound_hands_over_and_a_smaller_cache_elects_it_again() -> None:
    """The bound was checked against the most items ever tracked, and only for another
    candidate: one in charge kept the order however far the cache grew, and a cache
    that once passed the bound never elected it again."""
    duel = Duel([LRUPolicy, ARCPolicy, SLRUPolicy], sample_shift=0, most=(None, None, 10))
    duel.insert_many(range(10))
    assert duel.pop_victim(lambda _: True) == 0
    duel._minis[2].hits = 1000
    duel._elect()
    assert duel.leader == "slru"
    duel.insert_many(range(100, 120))  # 29 items
    duel._minis[1].hits = 50  # ARC ahead of LRU, far behind SLRU's score
    duel._elect()
    assert duel.leader == "arc" and duel.switches == 2
    assert sorted(duel.evictable()) == [*range(1, 10), *range(100, 120)]
    for item in range(100, 120):
        duel.remove(item)  # 9 items again
    duel._minis[2].hits = 10_000
    duel._elect()
    assert duel.leader == "slru" and duel.switches == 3
