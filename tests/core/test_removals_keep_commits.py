"""Nothing committed after a removal was asked for is lost to it, however long the
removal waits before its walk starts.

An evict whose first slice does not reach the end, or a drop of a big namespace, goes
on in a task: it may wait for get replies still being sent, or behind another removal
of the same namespace, before it walks.  What is committed into the namespace from the
request on is kept (with its prefixes); what was there when it was asked for goes as
before.  Each removal keeps from its own request: a commit made between two requests is
kept by the first and taken by the second.  First against the pure store
(``StoreCore.keep_commits`` taken at the request, the walk begun later), then through
``Removals`` itself, on an event loop, with the daemon's parts faked.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

from kvtest import make_identity

from kvstore import protocol as p
from kvstore.core import SubtreeDrop
from kvstore.index import NamespaceDrop
from kvstore.pending import Later
from kvstore.removals import DROP_SLICE, GET_OWNER, Removals
from kvstore.store import BlockStore, Namespace, Pin, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks


def commit(store: BlockStore, ns: Namespace, keys: list[bytes], parent: bytes | None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def new_store(capacity: int = 128 << 20) -> tuple[BlockStore, Namespace]:
    store = BlockStore(capacity, 1 << 20)
    return store, store.open_namespace(IDENT)


def comb(store: BlockStore, ns: Namespace, rng: random.Random, teeth: int,
         length: int) -> list[bytes]:
    """A trunk of ``teeth`` keys with a chain of ``length`` below each: the trunk."""
    trunk = [rng.randbytes(16) for _ in range(teeth)]
    commit(store, ns, trunk, None)
    for key in trunk:
        commit(store, ns, [rng.randbytes(16) for _ in range(length)], key)
    return trunk


def chain(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


def run_out(drop: SubtreeDrop | NamespaceDrop, store: BlockStore, budget: int = 37) -> None:
    while not drop.step(budget):
        store.check_invariants()
    store.check_invariants()


# -- the pure store -------------------------------------------------------------------------

def test_an_evict_keeps_what_was_committed_between_its_request_and_its_walk() -> None:
    store, ns = new_store()
    rng = random.Random(1)
    trunk = comb(store, ns, rng, 20, 30)
    keeping = store.keep_commits(ns)  # the evict is asked for; its walk starts later
    later = chain(rng, 5)
    commit(store, ns, later, trunk[7])  # below the evicted key, before the walk
    drop = SubtreeDrop(store, ns, [trunk[0]], keeping)
    run_out(drop, store)
    assert len(store.lookup(ns, trunk[:8] + later)) == 13  # kept, with its prefix
    assert set(ns.blocks) == set(trunk[:8] + later)
    assert drop.count == 20 + 20 * 30 - 8
    assert not store.dropping


def test_a_drop_keeps_what_was_committed_while_it_waited() -> None:
    store, ns = new_store()
    rng = random.Random(2)
    trunk = comb(store, ns, rng, 10, 30)
    keeping = store.keep_commits(ns)
    alone, onto = chain(rng, 4), chain(rng, 3)
    commit(store, ns, alone, None)
    commit(store, ns, onto, trunk[2])
    drop = NamespaceDrop(store, ns, keeping)  # begun after the commits
    assert drop.spare == {ns.blocks[k] for k in alone + onto}
    run_out(drop, store)
    assert set(ns.blocks) == set(alone + trunk[:3] + onto)
    assert not store.dropping


def test_each_removal_keeps_from_its_own_request() -> None:
    """Two removals asked one after the other, walked one after the other: a commit
    made between the requests is kept by the first and taken by the second; one made
    after both is kept by both."""
    store, ns = new_store()
    rng = random.Random(3)
    trunk = comb(store, ns, rng, 10, 20)
    first = store.keep_commits(ns)
    between = chain(rng, 6)
    commit(store, ns, between, trunk[4])
    second = store.keep_commits(ns)
    after = chain(rng, 2)
    commit(store, ns, after, None)
    evict = SubtreeDrop(store, ns, [trunk[0]], first)
    drop = NamespaceDrop(store, ns, second)  # (queued: begun now, walked after)
    run_out(evict, store)
    assert set(ns.blocks) == set(trunk[:5] + between + after)
    assert ns in store.dropping  # the second is still open
    run_out(drop, store)
    assert set(ns.blocks) == set(after)
    assert not store.dropping


def test_two_namespace_drops_stepped_in_turn_each_keep_their_own() -> None:
    """Two drops of one namespace walked in turn (not the daemon's order, the store's
    contract): a leaf one keeps and the other does not is still found by the other."""
    store, ns = new_store()
    rng = random.Random(4)
    trunk = comb(store, ns, rng, 30, 15)
    first = NamespaceDrop(store, ns)
    between = chain(rng, 3)
    commit(store, ns, between, trunk[12])
    second = NamespaceDrop(store, ns)
    after = chain(rng, 3)
    commit(store, ns, after, trunk[20])
    done = [False, False]
    while not all(done):
        for i, drop in enumerate((first, second)):
            if not done[i]:
                done[i] = drop.step(rng.randint(1, 40))
        store.check_invariants()
    assert set(ns.blocks) == set(trunk[:21] + after)
    assert not store.dropping


def test_the_store_holds_one_record_per_namespace_however_many_wait() -> None:
    store, ns = new_store()
    keepings = [store.keep_commits(ns) for _ in range(5)]
    assert len(store.dropping) == 1 and store.dropping[ns].open == 5
    for k in keepings[:4]:
        k.close()
        k.close()  # (twice is harmless)
    assert store.dropping[ns].open == 1
    keepings[4].close()
    assert not store.dropping


# -- through ``Removals``, on a loop ------------------------------------------------------------

class Transport:
    """Get replies "being sent" until ``go`` is set."""

    def __init__(self) -> None:
        self.trackers: list[tuple[str, int]] = []
        self.go: asyncio.Event | None = None

    def sending(self) -> list[str]:
        return [t for t, _ in self.trackers]

    def trackers_of(self, pins: set[int]) -> list[str]:
        return [t for t, pin in self.trackers if pin in pins]

    async def sent(self, trackers: list[str]) -> None:
        assert self.go is not None
        await self.go.wait()
        self.trackers = []


async def withdrawn() -> None:
    """(No SSD index here: nothing to wait for.)"""


def daemon_of(store: BlockStore) -> tuple[Removals, Transport, list[tuple[bytes, bytes]]]:
    removed: list[tuple[bytes, bytes]] = []
    transport = Transport()
    daemon: Any = SimpleNamespace(store=store, transport=transport,
                                  moves=SimpleNamespace(removed=removed.extend,
                                                        freed=lambda: None,
                                                        withdrawn=withdrawn),
                                  spawn=asyncio.ensure_future)
    return Removals(daemon), transport, removed


def count_of(reply: p.Message) -> int:
    assert isinstance(reply, p.CountReply)
    return reply.count


def test_an_evict_in_slices_keeps_a_commit_made_before_its_task_started() -> None:
    """(a) The first slice ran at the request; the commit lands before the task's."""
    store, ns = new_store()
    rng = random.Random(5)
    trunk = comb(store, ns, rng, 30, 300)  # 9030 blocks: more than a slice

    async def run() -> int:
        removals, _, _ = daemon_of(store)
        answer = removals.evict(1, ns, [trunk[0]])
        assert isinstance(answer, Later)
        commit(store, ns, later, trunk[3])
        return count_of(await answer.reply)

    later = chain(rng, 4)
    count = asyncio.run(run())
    assert set(ns.blocks) == set(trunk[:4] + later)
    assert count == 30 + 30 * 300 - 4
    assert not store.dropping
    store.check_invariants()


def test_removals_queued_behind_one_keep_what_was_committed_while_they_waited() -> None:
    """(b) An evict and a drop wait behind an evict of the same namespace; a commit
    made between their requests is kept by the evict asked before it and taken by the
    drop asked after it; one made after both, by neither."""
    store, ns = new_store()
    rng = random.Random(6)
    big = comb(store, ns, rng, 30, 300)
    other = comb(store, ns, rng, 30, 300)

    async def run() -> list[int]:
        removals, _, _ = daemon_of(store)
        first = removals.evict(1, ns, [big[0]])
        second = removals.evict(2, ns, [other[0]])
        commit(store, ns, early, other[5])  # after the second's request
        third = removals.drop(3, ns)
        commit(store, ns, late, other[9])  # after every request
        answers = [first, second, third]
        assert all(isinstance(a, Later) for a in answers)
        tasks = [asyncio.ensure_future(a.reply) for a in answers if isinstance(a, Later)]
        await asyncio.sleep(0)
        assert not tasks[0].done()  # (the first is walking: the others wait)
        commit(store, ns, latest, big[2])
        return [count_of(r) for r in await asyncio.gather(*tasks)]

    early, late, latest = chain(rng, 3), chain(rng, 3), chain(rng, 3)
    counts = asyncio.run(run())
    assert set(ns.blocks) == set(other[:10] + late + big[:3] + latest)
    assert not store.dropping
    # each counts what it removed itself: every block but those left
    assert counts[1:] == [30 + 30 * 300 - 10, 3]
    assert sum(counts) == 2 * (30 + 30 * 300) + 9 - len(ns.blocks)
    store.check_invariants()


async def behind_a_get(store: Any, ns: Any, keys: list[bytes], ask: Any,
                       later: list[bytes], parent: bytes) -> int:
    """A removal asked while a get reply of the asker's is unsent (so it all waits, no
    first slice), ``later`` committed under ``parent`` meanwhile; its count."""
    removals, transport, _ = daemon_of(store)
    pin = store.acquire(GET_OWNER, ns, keys[:2], 0.0)
    assert isinstance(pin, Pin)
    transport.trackers = [("reply", pin.id)]
    transport.go = asyncio.Event()
    answer = ask(removals)
    assert isinstance(answer, Later) and len(ns.blocks) == len(keys)
    task = asyncio.ensure_future(answer.reply)
    await asyncio.sleep(0)
    commit(store, ns, later, parent)  # while it waits
    store.release(GET_OWNER, pin.id)
    transport.go.set()
    return count_of(await task)


def test_a_small_drop_that_waits_for_get_replies_keeps_what_is_committed_meanwhile() -> None:
    store, ns = new_store()
    rng = random.Random(7)
    keys = chain(rng, 50)
    commit(store, ns, keys, None)

    async def run() -> int:
        return await behind_a_get(store, ns, keys, lambda removals: removals.drop(1, ns),
                                  later, keys[9])

    later = chain(rng, 2)
    assert asyncio.run(run()) == 50 - 10
    assert set(ns.blocks) == set(keys[:10] + later)
    assert not store.dropping


def test_an_evict_that_waits_for_get_replies_keeps_what_is_committed_meanwhile() -> None:
    """No first slice while its session's get replies are unsent: it all waits."""
    store, ns = new_store()
    rng = random.Random(11)
    keys = chain(rng, 50)
    commit(store, ns, keys, None)

    async def run() -> int:
        return await behind_a_get(
            store, ns, keys, lambda removals: removals.evict(1, ns, keys[:1]), later, keys[19])

    later = chain(rng, 3)
    assert asyncio.run(run()) == 50 - 20
    assert set(ns.blocks) == set(keys[:20] + later)
    assert not store.dropping


def test_a_removal_given_up_before_it_ran_stops_keeping() -> None:
    """A request's reply coroutine closed before its task ever ran (the daemon gave it
    up): the store stops keeping commits for it."""
    store, ns = new_store()
    rng = random.Random(8)
    trunk = comb(store, ns, rng, 20, DROP_SLICE // 10)
    removals, _, _ = daemon_of(store)
    answer = removals.evict(1, ns, [trunk[0]])
    assert isinstance(answer, Later) and ns in store.dropping
    answer.reply.close()
    del answer
    assert not store.dropping


def test_a_removal_given_up_stops_keeping_at_once() -> None:
    """The server gives a request up before its task ran (``Later.gave_up`` beside
    ``reply.close()``): the claim ends then, while the coroutine is still held (not
    only when it is freed), and a commit made after is no longer kept for it."""
    store, ns = new_store()
    rng = random.Random(12)
    trunk = comb(store, ns, rng, 20, DROP_SLICE // 10)
    removals, _, _ = daemon_of(store)
    answer = removals.drop(1, ns)
    assert isinstance(answer, Later) and ns in store.dropping
    keeping = store.dropping[ns]
    answer.reply.close()
    assert ns in store.dropping  # (the coroutine still held: the finalizer waits)
    answer.gave_up()
    assert not store.dropping
    commit(store, ns, chain(rng, 3), trunk[0])
    assert not keeping.spare and not keeping.buckets
    answer.gave_up()  # twice is harmless
    assert not store.dropping


# -- the sweep below a hollow entry -------------------------------------------------------------

def test_a_hollow_entry_committed_again_mid_sweep_keeps_itself_and_what_is_below() -> None:
    """The sweep below a hollow entry goes on over later calls (the daemon's loop
    turns); a commit that gives the entry a copy again ends its reason: the entry, what
    is committed below it after, and what still hangs below it stay (the walk went on
    and dropped them all, the revived entry last)."""
    store, ns = new_store()
    rng = random.Random(9)
    trunk = comb(store, ns, rng, 12, 300)  # 3612 blocks: more than a sweep's call
    pin = store.acquire("reader", ns, trunk[5:9], 0.0)  # in use below: kept the entry
    assert isinstance(pin, Pin)
    root = ns.blocks[trunk[0]]
    store.drop_dram_copy(root)  # lost its last copy, as to a corrupt read: hollow
    store.hollow.add(root)
    store.sweep_later = lambda: None  # (the daemon's: another call a loop turn later)
    assert not store.sweep_hollow()  # a first bounded call
    commit(store, ns, [trunk[0]], None)  # the entry committed again: a copy
    later = chain(rng, 4)
    commit(store, ns, later, trunk[0])
    left = set(ns.blocks)
    while not store.sweep_hollow():
        store.check_invariants()
    store.release("reader", pin.id)
    assert root.present and root not in store.hollow
    assert len(store.lookup(ns, [trunk[0]] + later)) == 1 + len(later)
    assert set(ns.blocks) == left
    store.check_invariants()


def test_the_marks_of_entries_gone_go_with_them() -> None:
    """Removals queued one behind another keep the namespace's record open for long:
    what it marks of entries removed since goes, so it holds no more than the live."""
    store, ns = new_store()
    rng = random.Random(10)
    keeping = store.keep_commits(ns)
    for _ in range(50):
        keys = chain(rng, 8)
        commit(store, ns, keys, None)
        store.evict(ns, keys[:1])
    kept = chain(rng, 3)
    commit(store, ns, kept, None)
    assert set(store.dropping[ns].spare) == {ns.blocks[k] for k in kept}
    keeping.close()
