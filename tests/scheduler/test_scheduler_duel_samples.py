"""A duel's sampled references kept for later turns (``kvstore.scheduler.duel_samples``):
its miniatures end as they would have taking each at once, whatever the real cache did
meanwhile; a request takes its share at once; a backlog is bounded; a released duel's
backlog goes with it."""

from __future__ import annotations

import random
import sys
from collections.abc import Hashable
from pathlib import Path

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.scheduler import duel_samples
from kvstore.scheduler.duel_samples import A_TURN, Backlogs
from kvstore.scheduler.eviction import AutoPolicy
from kvstore.scheduler.sampling import GOLDEN
from kvstore.store import BlockStore, Reservation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_sim  # noqa: E402  (benchmarks/ is no package)

CAPACITY = 150  # blocks: the trace's chains turn it over many times


def _trace(seed: int) -> list[replay_sim.TraceRequest]:
    """Conversations (turns that extend their context) and one-time chains, mixed."""
    rng = random.Random(seed)
    trace: list[replay_sim.TraceRequest] = []
    talks: list[list[int]] = []
    fresh = 1
    for _ in range(900):
        if talks and rng.random() < 0.6:
            ids = rng.choice(talks)
        else:
            ids = []
            talks.append(ids)
        grown = rng.randrange(1, 24)
        ids += range(fresh, fresh + grown)
        fresh += grown
        trace.append(replay_sim.TraceRequest(0, len(ids) * 512, 1, list(ids)))
    return trace


def _auto(frozen: bool, sample_shift: int = 0) -> AutoPolicy[Hashable]:
    # every key sampled (by default): a key's parent is in the miniatures too
    duel: AutoPolicy[Hashable] = AutoPolicy(sample_shift=sample_shift)
    if frozen:  # no hand-over: the real cache's choices do not depend on the miniatures
        duel.margin = 1e9
        duel.reality.z = None
    return duel


def _state(duel: AutoPolicy[Hashable]) -> tuple[object, ...]:
    minis = tuple((m.hits, round(m.score, 9), m.held,
                   [node.key for node in m.order.evictable()]) for m in duel._minis)
    return (minis, duel._sampled, duel.reality.ahead, duel.reality.behind,
            sorted(duel._nodes.keys()), duel.switches, duel.leader)


def _run(duel: AutoPolicy[Hashable], trace: list[replay_sim.TraceRequest],
         backlogs: Backlogs | None, rng: random.Random) -> replay_sim.PolicyCache:
    cache = replay_sim.PolicyCache(duel, CAPACITY, touches=2)
    carried = 0  # requests that found references of earlier ones still waiting
    for request in trace:
        carried += bool(duel._backlog)
        if backlogs is not None:
            backlogs.allowance = rng.choice((0, 0, 1, 3))  # most of it kept for later
        hits = cache.lookup(request.hash_ids)
        cache.insert(request.hash_ids, hits)
        if backlogs is not None and rng.random() < 0.2:
            # a slice now and then: some wait on for many requests, past their
            # blocks' eviction
            backlogs.catch_up(rng.randrange(1, 200))
    assert backlogs is None or carried > 100
    return cache


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_references_taken_later_leave_the_miniatures_as_taken_at_once(seed: int) -> None:
    trace = _trace(seed)
    now, later = _auto(frozen=True), _auto(frozen=True)
    backlogs = Backlogs()
    later.defer_to(backlogs)
    at_once = _run(now, trace, None, random.Random(seed))
    kept = _run(later, trace, backlogs, random.Random(seed))
    assert kept.evictions == at_once.evictions > 1000  # the cache turned over
    assert backlogs.taken > 1000, "nothing was left for later: the test tests nothing"
    backlogs.catch_up(10**9)
    assert not backlogs.waiting and not later._backlog
    # the parents were read as they were (the cache forgets a victim's parent)
    assert _state(later) == _state(now)


def test_with_elections_a_duel_whose_references_wait_still_hands_over() -> None:
    trace = _trace(4)
    duel = _auto(frozen=False)
    backlogs = Backlogs()
    duel.defer_to(backlogs)
    cache = replay_sim.PolicyCache(duel, CAPACITY, touches=2)
    for request in trace * 3:
        backlogs.allowance = 0
        hits = cache.lookup(request.hash_ids)
        cache.insert(request.hash_ids, hits)
        backlogs.catch_up()
    assert duel.switches >= 1 and backlogs.taken > 0
    assert len(duel) + len(duel._pinned) == len(cache._children)


def test_a_request_takes_its_share_at_once_and_the_rest_waits() -> None:
    duel = _auto(frozen=True, sample_shift=3)
    backlogs = Backlogs()
    duel.defer_to(backlogs)
    duel.expect(1 << 16)
    items = list(range(1, 20_000))
    sampled = sum(1 for i in items if not (i * GOLDEN) & duel._sample_mask)
    duel.insert_many(items)
    assert sampled > A_TURN
    assert backlogs.allowance == 0 and len(duel._backlog) == sampled - A_TURN
    assert len(backlogs) == sampled - A_TURN and list(backlogs.waiting) == [duel]
    duel.insert(10**9)  # (sampled or not) after those kept: never ahead of them
    assert backlogs.allowance == 0
    backlogs.next_request()
    assert backlogs.allowance == A_TURN
    assert backlogs.catch_up(5) is True and backlogs.taken == 5
    while backlogs.catch_up():
        pass
    assert len(backlogs) == 0 and not backlogs.waiting


def test_a_backlog_is_bounded_and_takes_its_oldest_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(duel_samples, "BACKLOG_MOST", 16)
    trace = _trace(5)
    now, later = _auto(frozen=True), _auto(frozen=True)
    backlogs = Backlogs()
    later.defer_to(backlogs)
    rng = random.Random(5)
    cache = replay_sim.PolicyCache(later, CAPACITY, touches=2)
    for request in trace:
        backlogs.allowance = 0
        cache.insert(request.hash_ids, cache.lookup(request.hash_ids))
        assert len(later._backlog) <= 16
    assert len(later._backlog) == 16
    _run(now, trace, None, rng)
    backlogs.catch_up(10**9)
    assert _state(later) == _state(now)


def test_a_released_duel_lets_its_backlog_go() -> None:
    duel = _auto(frozen=True)
    backlogs = Backlogs()
    duel.defer_to(backlogs)
    backlogs.allowance = 0
    cache = replay_sim.PolicyCache(duel, CAPACITY)
    for request in _trace(6)[:200]:
        cache.insert(request.hash_ids, cache.lookup(request.hash_ids))
    assert duel._backlog and duel in backlogs.waiting
    duel.release()
    assert backlogs.catch_up() is False
    assert not backlogs.waiting and backlogs.taken == 0



def test_a_duel_switched_away_from_with_references_waiting_is_let_go_cleanly() -> None:
    # its references kept, then a change of policy in steps that drains and takes the
    # duel apart while the loop's turns take slices of the backlogs (a KeyError from
    # the half-dismantled miniatures before: the backlogs never drained again)
    ident = make_identity()
    store = BlockStore(512 * ident.block_bytes, 512 * ident.block_bytes,
                       eviction_policy="auto", clock=lambda: 0.0, samples_later=True)
    ns, tokens, backlogs = store.open_namespace(ident), ident.block_tokens, store.backlogs
    assert backlogs is not None
    for i in range(300):  # a daemon's big commits: past the allowance
        backlogs.allowance = 0
        keys = chain_keys(ns.id, list(range(i * 1000, i * 1000 + 8 * tokens)), tokens)
        r = store.reserve("o", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("o", r.id, 0.0)
        store.lookup(ns, keys)
    assert len(backlogs) > 0
    store.set_eviction_policy("lru")
    while store.switch_step(256):
        backlogs.catch_up(1)
    assert backlogs.catch_up() is False and len(backlogs) == 0
    store.check_invariants()
    store.set_eviction_policy("auto")  # and back: the new duel keeps and takes its own
    for i in range(300, 400):
        backlogs.allowance = 0
        keys = chain_keys(ns.id, list(range(i * 1000, i * 1000 + 8 * tokens)), tokens)
        r = store.reserve("o", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("o", r.id, 0.0)
        while store.switch_step(256):
            backlogs.catch_up(1)
    assert len(backlogs) > 0
    while backlogs.catch_up():
        pass
    store.check_invariants()


def test_a_failing_slice_lets_that_duels_references_go_and_the_others_on() -> None:
    bad, good = _auto(frozen=True, sample_shift=0), _auto(frozen=True, sample_shift=0)
    backlogs = Backlogs()
    for duel in (bad, good):
        duel.defer_to(backlogs)
        cache = replay_sim.PolicyCache(duel, CAPACITY)
        backlogs.allowance = 0
        for request in _trace(7)[:50]:
            cache.insert(request.hash_ids, cache.lookup(request.hash_ids))

    def broken(most: int) -> int:
        raise RuntimeError("a bug")

    bad.catch_up = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        backlogs.catch_up()
    assert list(backlogs.waiting) == [good] and not bad._backlog
    while backlogs.catch_up():
        pass
    assert not good._backlog


def test_references_that_wait_do_not_cut_a_commit_into_runs() -> None:
    # one sampled reference short of an election: the ones that wait hold none, so the
    # commit's items still go to the order in charge in one call
    duel = _auto(frozen=True, sample_shift=3)
    backlogs = Backlogs()
    duel.defer_to(backlogs)
    duel.expect(1 << 16)
    duel.insert_many(list(range(1, 2000)))
    backlogs.allowance = 0
    duel._sampled = duel.epoch - 1
    calls: list[int] = []
    order = duel._order
    real = order.insert_many

    def counted(items: list[Hashable]) -> None:
        calls.append(len(items))
        real(items)

    order.insert_many = counted  # type: ignore[method-assign]
    duel.insert_many(list(range(10_000, 14_096)))
    assert calls == [4096] and len(duel._backlog) > 400
