"""Two writers reserving the same uncommitted keys at once: with ``skip_held`` the
second takes no slot for a key the first holds one for (``Reservation.awaited``, offset
-1), so under pressure it evicts nothing for it.  At its commit each awaited key must be
cached by then (the first committed): else it and the keys after it are not stored
(``dropped``), their slots go back, and no block hangs without its parent.  A reserve
without ``skip_held`` (an older client), or a put's (``Skip.HELD``), takes a slot for
every such key as before."""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.blocks import writers
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Limits, Namespace, Reservation, Skip

IDENT = make_identity(tenant="acme", model="m")
COLD = make_identity(tenant="acme", model="cold")
SLOT = IDENT.block_bytes
BT = IDENT.block_tokens


def _store(slots: int = 16) -> BlockStore:
    return BlockStore(slots * SLOT, 8 * SLOT, limits=Limits(lease_seconds=5.0))


def _chain(ns: Namespace, n: int, first: int = 0) -> list[bytes]:
    return chain_keys(ns.id, list(range(first * BT, (first + n) * BT)), BT)


def _reserve(store: BlockStore, owner: str, ns: Namespace, keys: list[bytes],
             parent: bytes | None = None, skip: bool | int = True,
             now: float = 0.0) -> Reservation:
    r = store.reserve(owner, ns, keys, parent, now, skip)
    assert isinstance(r, Reservation), r
    return r


def _pending(ns: Namespace) -> dict[bytes, int]:
    """Each pending key: how many open reservations hold a slot for it."""
    return {key: len(writers(held)) for key, held in ns.pending.items()}


def _settled(store: BlockStore, ns: Namespace) -> None:
    store.check_invariants()
    assert _pending(ns) == {} and store.reserved_slots == 0
    assert store.pinned_blocks == 0


def test_a_second_writer_of_pending_keys_takes_no_slot_and_its_commit_is_duplicates() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 4)
    a = _reserve(store, "a", ns, keys)
    b = _reserve(store, "b", ns, keys)
    assert a.slots() == a.offsets and len(a.offsets) == 4
    assert b.slots() == [-1] * 4 and b.offsets == [] and b.awaited == frozenset(range(4))
    assert store.reserved_slots == 4 and _pending(ns) == {k: 1 for k in keys}
    store.check_invariants()
    assert store.commit("a", a.id, 0.0).created == 4
    done = store.commit("b", b.id, 0.0)
    assert (done.created, done.duplicates, done.dropped) == (0, 4, 0)
    assert store.counters.duplicate_blocks == 4 and store.committed_slots == 4
    assert store.counters.awaited_keys == 4
    _settled(store, ns)


def test_under_pressure_the_second_writer_evicts_nothing_for_the_keys() -> None:
    store = _store(8)  # one slab of 8 slots: 6 cold blocks, 2 free
    cold_ns = store.open_namespace(COLD)
    store.commit("cold", _reserve(store, "cold", cold_ns, _chain(cold_ns, 6)).id, 0.0)
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 4)
    a = _reserve(store, "a", ns, keys)
    assert store.counters.evictions == 2
    b = _reserve(store, "b", ns, keys)
    assert store.counters.evictions == 2, "a slot taken again for keys pending"
    store.commit("b", b.id, 0.0)  # before the first writer: nothing stored, nothing lost
    store.commit("a", a.id, 0.0)
    assert len(cold_ns.blocks) == 4 and store.lookup(ns, keys) == ["dram"] * 4
    _settled(store, ns)


def test_the_first_writer_aborted_the_second_stores_nothing_after_the_gap() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 6)
    a = _reserve(store, "a", ns, keys[:4])
    b = _reserve(store, "b", ns, keys)  # the first four awaited, two slots of its own
    assert b.slots()[:4] == [-1] * 4 and min(b.slots()[4:]) >= 0
    assert store.reserved_slots == 6
    store.abort("a", a.id)
    done = store.commit("b", b.id, 0.0)
    assert (done.created, done.duplicates, done.dropped) == (0, 0, 6)
    assert store.counters.awaited_dropped == 6
    assert not any(k in ns.blocks for k in keys), "a block without its parent"
    assert store.committed_slots == 0
    _settled(store, ns)
    assert store.stats()["free"] == 16 * SLOT  # b's two slots went back


def test_the_first_writers_lease_ran_out_the_second_stores_nothing_after_the_gap() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 5)
    a = _reserve(store, "a", ns, keys[:3], now=0.0)
    b = _reserve(store, "b", ns, keys, now=3.0)
    assert b.awaited == {0, 1, 2}
    assert store.expire(6.0) == ["a"]  # a's lease ended at 5, b's at 8
    assert _pending(ns) == {keys[3]: 1, keys[4]: 1}
    done = store.commit("b", b.id, 6.0)
    assert (done.created, done.dropped) == (0, 5)
    assert store.lookup(ns, keys) == []
    _settled(store, ns)


def test_a_chain_whose_middle_key_is_pending_elsewhere() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 4)
    store.commit("w", _reserve(store, "w", ns, keys[:1]).id, 0.0)
    for first_ends in ("commit", "abort"):
        a = _reserve(store, "a", ns, keys[1:2], parent=keys[0])
        b = _reserve(store, "b", ns, keys)  # held, awaited, two slots of its own
        assert list(b.held) == [0] and b.awaited == {1} and len(b.offsets) == 2
        assert b.slots()[:2] == [-1, -1]
        if first_ends == "commit":
            store.commit("a", a.id, 0.0)
            done = store.commit("b", b.id, 0.0)
            assert (done.created, done.duplicates, done.dropped) == (2, 2, 0)
            assert ns.blocks[keys[2]].parent is ns.blocks[keys[1]]
            assert store.lookup(ns, keys) == ["dram"] * 4
            store.evict(ns, keys[1:])
        else:
            store.abort("a", a.id)
            done = store.commit("b", b.id, 0.0)
            assert (done.created, done.duplicates, done.dropped) == (0, 1, 3)
            assert store.lookup(ns, keys) == ["dram"]
            assert not any(k in ns.blocks for k in keys[1:])
        _settled(store, ns)


def test_an_awaited_key_committed_is_pinned_for_the_second_writer_till_its_commit() -> None:
    """Between the two commits an eviction found the first writer's blocks unpinned: the
    second commit found a gap and dropped its own blocks after it."""
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 3)
    a = _reserve(store, "a", ns, keys[:2])
    b = _reserve(store, "b", ns, keys)
    assert b.awaits == {a} and a.awaited_by == {b}
    store.commit("a", a.id, 0.0)
    assert list(b.held) == [0, 1] and not b.awaited and not b.awaits
    assert store.pinned_blocks == 2
    store.check_invariants()
    assert store.evict(ns, keys[1:2])[0] == 0  # pinned for b: not evicted
    done = store.commit("b", b.id, 0.0)
    assert (done.created, done.duplicates, done.dropped) == (1, 2, 0)
    assert store.lookup(ns, keys) == ["dram"] * 3
    _settled(store, ns)


def test_under_pressure_between_the_commits_no_gap() -> None:
    store = _store(8)  # one slab of 8 slots
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 6)
    a = _reserve(store, "a", ns, keys[:4])
    b = _reserve(store, "b", ns, keys)  # 4 awaited, 2 slots of its own
    store.commit("a", a.id, 0.0)
    cold_ns = store.open_namespace(COLD)  # room for 2 more only by evicting
    with pytest.raises(CapacityError):  # only a's blocks to evict: pinned for b
        store.reserve("cold", cold_ns, _chain(cold_ns, 4), None, 0.0)
    assert store.counters.evictions == 0
    assert store.commit("b", b.id, 0.0).dropped == 0
    assert store.lookup(ns, keys) == ["dram"] * 6
    _settled(store, ns)


def test_the_second_writer_is_woken_when_the_writers_it_awaits_end() -> None:
    """``Reservation.wake``: when the last reservation it awaits ends, however it ends,
    and when it ends itself (its session gone while its commit waits)."""
    for end in ("commit", "abort", "lease", "own end"):
        store = _store()
        ns = store.open_namespace(IDENT)
        keys = _chain(ns, 4)
        a1 = _reserve(store, "a1", ns, keys[:2])
        a2 = _reserve(store, "a2", ns, keys[:3], skip=False, now=2.0)  # the third: a2 only
        b = _reserve(store, "b", ns, keys, now=2.0)
        assert b.awaits == {a1, a2} and b.awaited == {0, 1, 2} and len(b.offsets) == 1
        woken: list[str] = []
        b.wake = lambda: woken.append(end)
        if end == "own end":
            store.drop_owner("b")
            assert woken == [end] and not a1.awaited_by and not a2.awaited_by
            store.abort("a1", a1.id)
            store.abort("a2", a2.id)
            _settled(store, ns)
            continue
        if end == "commit":
            store.commit("a1", a1.id, 3.0)
        elif end == "abort":
            store.abort("a1", a1.id)
        else:
            assert store.expire(6.0) == ["a1"]  # a1's lease ended at 5, a2's at 7
        assert woken == [] and b.awaits == {a2}, "woken while a2 is open"
        store.check_invariants()
        store.abort("a2", a2.id)
        assert woken == [end] and not b.awaits
        done = store.commit("b", b.id, 6.0)
        # the keys a1 stored were pinned for b; a2's third key was not stored: the gap
        assert done.dropped == (2 if end == "commit" else 4), end
        _settled(store, ns)


def test_keys_pending_in_a_reservation_of_the_same_session_take_a_slot() -> None:
    """Its commit waits for no reservation of its own session: the client may commit
    that one only after this one's reply."""
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 4)
    first = _reserve(store, "a", ns, keys[:2])
    other = _reserve(store, "b", ns, keys[2:])
    second = _reserve(store, "a", ns, keys)
    assert second.awaited == {2, 3} and second.awaits == {other}
    assert min(second.slots()[:2]) >= 0
    store.commit("b", other.id, 0.0)
    done = store.commit("a", second.id, 0.0)
    assert (done.created, done.duplicates, done.dropped) == (2, 2, 0)
    assert store.commit("a", first.id, 0.0).duplicates == 2
    _settled(store, ns)


def test_without_skip_held_or_for_a_put_every_key_takes_a_slot_as_before() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    keys = _chain(ns, 4)
    a = _reserve(store, "a", ns, keys)
    old = _reserve(store, "old", ns, keys, skip=False)
    put = _reserve(store, "put", ns, keys, skip=Skip.HELD)
    assert min(old.slots()) >= 0 and min(put.slots()) >= 0 and not old.awaited
    assert store.reserved_slots == 12 and _pending(ns) == {k: 3 for k in keys}
    store.check_invariants()
    assert store.commit("put", put.id, 0.0).created == 4
    done = store.commit("old", old.id, 0.0)
    assert (done.created, done.duplicates) == (0, 4)
    store.abort("a", a.id)
    _settled(store, ns)


def test_a_key_twice_in_one_reservation_is_not_awaited_from_itself() -> None:
    store = _store()
    ns = store.open_namespace(IDENT)
    key = _chain(ns, 1)[0]
    r = _reserve(store, "a", ns, [key, key])
    assert not r.awaited and len(r.offsets) == 2 and _pending(ns) == {key: 2}
    done = store.commit("a", r.id, 0.0)
    assert (done.created, done.duplicates, done.dropped) == (1, 1, 0)
    _settled(store, ns)
