"""A big commit's blocks put on their eviction order a step a turn (``kvstore.order_holds``):
the order hears of every block in the order one call would have told it, the blocks held
meanwhile are found, read and pinned like any other but never evicted, every invariant
holds between the turns, and a request short of room waits for them, not refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from kvtest import make_identity

from kvstore import order_holds
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.moves import Moves
from kvstore.plans import Plan
from kvstore.store import BlockStore, Namespace

IDENT = make_identity()
SLOT = IDENT.block_bytes
STEP = 4  # (a small step: the same code paths as 1024)


class Turns:
    """A loop's ``call_soon`` that keeps the callbacks to run when the test says."""

    def __init__(self) -> None:
        self.due: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.due.append(callback)

    def run(self) -> int:
        """Run the callbacks due now (one turn); how many ran."""
        due, self.due = self.due, []
        for callback in due:
            callback()
        return len(due)


def keys(ns: Namespace, first: int, blocks: int) -> list[bytes]:
    bt = IDENT.block_tokens
    return chain_keys(ns.id, list(range(first, first + blocks * bt)), bt)


def commit(store: BlockStore, ns: Namespace, chain: list[bytes], owner: str = "w") -> None:
    r = store.reserve(owner, ns, chain, None, 0.0)
    assert not isinstance(r, Plan), r
    store.commit(owner, r.id, 0.0)


def order(store: BlockStore, ns: Namespace) -> list[bytes]:
    return [b.key for b in ns.dram.policy(ns.cls).evictable()]


@pytest.fixture(autouse=True)
def small_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(order_holds, "STEP", STEP)


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_a_big_commit_reaches_its_order_in_steps_in_the_order_of_one_call(policy: str) -> None:
    plain = BlockStore(64 * SLOT, 16 * SLOT, eviction_policy=policy)
    held = BlockStore(64 * SLOT, 16 * SLOT, eviction_policy=policy)
    turns = Turns()
    freed: list[int] = []
    held.holds.run_on(turns, lambda: freed.append(1))  # type: ignore[arg-type]
    a, b = plain.open_namespace(IDENT), held.open_namespace(IDENT)
    for store, ns in ((plain, a), (held, b)):
        commit(store, ns, keys(ns, 0, 3))  # small: on the order at once
        commit(store, ns, keys(ns, 10_000, 11))  # 4 now, 7 held: 4 and 3 in two turns
        commit(store, ns, keys(ns, 20_000, 2))
    assert len(held.holds) == 7 and held.pinned_blocks == 7
    assert held.stats()["held_blocks"] == 7 and held.stats()["pinned_blocks"] == 7
    assert len(order(held, b)) == 3 + 4 + 2 and all(
        b.blocks[k].refs == 1 for k in keys(b, 10_000, 7))
    held.check_invariants()
    assert held.lookup(b, keys(b, 10_000, 11)) == ["dram"] * 11  # found meanwhile
    assert turns.run() == 1 and len(held.holds) == 3 and freed == [1]
    held.check_invariants()
    assert turns.run() == 1 and len(held.holds) == 0 and not turns.due
    assert held.pinned_blocks == 0 and not b.dram.pinned and held.stats()["held_blocks"] == 0
    held.check_invariants()
    # the same blocks on the order; the one-call order but for the later commit's place
    tail = keys(a, 20_000, 2)
    assert [k for k in order(plain, a) if k not in tail] == [
        k for k in order(held, b) if k not in tail]
    assert sorted(order(plain, a)) == sorted(order(held, b))


def test_a_held_block_pinned_by_a_client_meanwhile_stays_off_the_order_until_let_go() -> None:
    store = BlockStore(64 * SLOT, 16 * SLOT, eviction_policy="lru")
    turns = Turns()
    store.holds.run_on(turns, lambda: None)  # type: ignore[arg-type]
    ns = store.open_namespace(IDENT)
    chain = keys(ns, 0, 8)
    commit(store, ns, chain)  # 4 held
    pin = store.acquire("reader", ns, chain[:2], 0.0)
    assert not isinstance(pin, Plan) and ns.blocks[chain[0]].refs == 2
    store.release("reader", pin.id)  # let go before the turn: still held
    pin = store.acquire("reader", ns, chain[:1], 0.0)
    assert not isinstance(pin, Plan)
    turns.run()
    store.check_invariants()
    assert chain[0] not in order(store, ns) and chain[1] in order(store, ns)
    assert store.pinned_blocks == 1
    store.release("reader", pin.id)
    assert chain[0] in order(store, ns) and store.pinned_blocks == 0
    store.check_invariants()


def test_held_blocks_are_never_evicted_and_a_request_short_of_room_waits_for_them() -> None:
    """DRAM full of a big commit's blocks, most still held: a request that needs them
    evicted is answered with a wait for room (``room_coming``), not refused; once they
    are on the order, it is served by evicting them."""
    store = BlockStore(16 * SLOT, 16 * SLOT, eviction_policy="lru")
    turns = Turns()
    store.holds.run_on(turns, lambda: None)  # type: ignore[arg-type]
    ns = store.open_namespace(IDENT)
    first = keys(ns, 0, 16)
    commit(store, ns, first)  # 12 held, 4 on the order
    later = keys(ns, 50_000, 8)
    r = store.reserve("w", ns, later, None, 0.0)
    assert isinstance(r, Plan) and r.room_coming, r
    assert all(ns.blocks[k].offset is not None for k in first)
    while turns.run():
        pass
    r = store.reserve("w", ns, later, None, 0.0)
    assert not isinstance(r, Plan)
    store.commit("w", r.id, 0.0)
    store.check_invariants()


def test_without_a_loop_nothing_is_held() -> None:
    """The simulators and in-process stores: a big commit on the order at once."""
    store = BlockStore(64 * SLOT, 16 * SLOT, eviction_policy="lru")
    ns = store.open_namespace(IDENT)
    commit(store, ns, keys(ns, 0, 20))
    assert len(store.holds) == 0 and len(order(store, ns)) == 20


def test_the_daemons_mover_holds_big_commits_and_puts_them_on_in_turns() -> None:
    """Through the mover pipeline on a running loop (as the daemon starts it): the held
    blocks reach the order within a few turns, a waiting request served meanwhile."""
    store = BlockStore(16 * SLOT, 16 * SLOT, eviction_policy="lru")
    ns = store.open_namespace(IDENT)
    moves = Moves(store, lambda: 0.0)

    async def run() -> None:
        moves.start()
        commit(store, ns, keys(ns, 0, 16))
        assert len(store.holds) == 12
        later = keys(ns, 50_000, 8)
        r = await moves.settle(lambda: store.reserve("w", ns, later, None, 0.0))
        assert not isinstance(r, Plan)
        assert len(store.holds) == 0
        store.commit("w", r.id, 0.0)

    asyncio.run(run())
    store.check_invariants()
    pin = store.acquire("reader", ns, keys(ns, 50_000, 8), 0.0)
    assert not isinstance(pin, Plan)
    with pytest.raises(CapacityError):  # (pins still refuse: nothing held is coming)
        store.reserve("w", ns, keys(ns, 90_000, 16), None, 0.0)
