"""Which commit's wait would close a cycle of sessions (``commit_waits.closes_cycle``): a
session whose commit waits commits nothing else till its reply, so it waits for the
sessions of the reservations that commit awaits.  Over a store, no daemon."""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.commit_waits import closes_cycle, cycle_breaker, own_lost
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Limits, Namespace, Reservation

IDENT = make_identity(tenant="acme", model="cycles")
BT = IDENT.block_tokens


def _chain(ns: Namespace, first: int, n: int) -> list[bytes]:
    return chain_keys(ns.id, list(range(first * BT, (first + n) * BT)), BT)


def _rings(sessions: int) -> tuple[BlockStore, list[Reservation]]:
    """Each session holds an older reservation of a chain of its own and a younger one
    of the next session's chain and a key more (that chain's keys awaited): the younger
    reservations, by session, and the store."""
    store = BlockStore(64 * IDENT.block_bytes, 8 * IDENT.block_bytes,
                       limits=Limits(lease_seconds=5.0))
    ns = store.open_namespace(IDENT)
    chains = [_chain(ns, 100 * s, 3) for s in range(sessions)]
    for s in range(sessions):
        store.reserve(f"s{s}", ns, chains[s][:2], None, 0.0, True)
    younger = []
    for s in range(sessions):
        r = store.reserve(f"s{s}", ns, chains[(s + 1) % sessions], None, 0.0, True)
        assert isinstance(r, Reservation) and r.awaited == {0, 1}, r
        younger.append(r)
    return store, younger


def test_the_last_of_three_sessions_to_wait_closes_the_cycle() -> None:
    _, (a, b, c) = _rings(3)
    assert not closes_cycle(a, [])
    assert not closes_cycle(b, [a])  # a waits for b's older one: b may commit it
    assert closes_cycle(c, [a, b])  # c -> a's session -> b's -> c's
    assert not closes_cycle(c, [a])  # b's session waits for nothing: it commits
    assert not closes_cycle(c, [b])


def test_two_sessions_each_waiting_for_the_others_older_reservation() -> None:
    _, (a, b) = _rings(2)
    assert not closes_cycle(a, [])
    assert closes_cycle(a, [b]) and closes_cycle(b, [a])



def test_the_breaker_is_the_commit_losing_fewest_blocks_of_its_own_bytes() -> None:
    store, (a, b, c) = _rings(3)  # each: 2 keys awaited, 1 of its own after them
    assert [own_lost(r) for r in (a, b, c)] == [1, 1, 1]
    assert cycle_breaker(c, [a, b]) is c  # a tie: the closer
    # c's session reserves the same awaited keys with 4 of its own after them
    d = store.reserve(c.owner, c.ns, _chain(c.ns, 0, 6), None, 0.0, True)
    assert isinstance(d, Reservation) and d.awaited == {0, 1}, d
    assert own_lost(d) == 4 and closes_cycle(d, [a, b])
    assert cycle_breaker(d, [a, b]) is a  # a's end opens the cycle: 1 block lost
    assert cycle_breaker(d, [a, b, c]) is a  # (c's end alone opens none: d's own too)


def test_the_breaker_is_sought_among_a_few_waiting_commits_not_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Session A holds an older reservation and many younger ones, each awaiting B's older
    one and adding a block of its own; B's commit of a reservation awaiting A's older one,
    with ten blocks of its own, closes a cycle through each.  Each waiting commit losing
    fewer blocks was tried as the breaker, each try a walk of every waiting commit: a few
    sessions' hundreds of waiting commits took the loop seconds, commit after commit.
    Now only ``CYCLE_CANDIDATES`` are tried, fewest lost first; none opening every
    cycle, B's commit goes on itself."""
    from kvstore import commit_waits

    store = BlockStore(512 * IDENT.block_bytes, 8 * IDENT.block_bytes,
                       limits=Limits(lease_seconds=5.0))
    ns = store.open_namespace(IDENT)
    x, y = _chain(ns, 0, 1), _chain(ns, 1000, 1)
    store.reserve("a", ns, x, None, 0.0, True)
    store.reserve("b", ns, y, None, 0.0, True)
    waiting = []
    for i in range(64):
        keys = y + chain_keys(ns.id, list(range(1000 * BT, 1001 * BT))
                              + list(range((2000 + i) * BT, (2001 + i) * BT)), BT)[1:]
        r = store.reserve("a", ns, keys, None, 0.0, True)
        assert isinstance(r, Reservation) and r.awaited == {0}, r
        waiting.append(r)
    closer = store.reserve("b", ns, _chain(ns, 0, 11), None, 0.0, True)
    assert isinstance(closer, Reservation) and closer.awaited == {0}
    assert closes_cycle(closer, waiting) and own_lost(closer) == 10
    walks: list[Reservation] = []
    monkeypatch.setattr(commit_waits, "closes_cycle",
                        lambda r, ws: walks.append(r) or closes_cycle(r, ws))
    assert cycle_breaker(closer, waiting) is closer
    assert len(walks) <= 8, len(walks)  # (``CYCLE_CANDIDATES``)
    # where one of them opens every cycle, the one losing fewest is still found
    assert cycle_breaker(closer, waiting[:1]) is waiting[0]
