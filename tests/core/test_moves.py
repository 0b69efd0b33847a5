"""The mover pipeline's own parts, without a daemon: the one wait for room (order,
deadlines), and a plan that never runs leaving nothing marked."""

from __future__ import annotations

import asyncio

import pytest
from kvtest import make_identity

from kvstore.blocks import Block
from kvstore.errors import CapacityError

from kvstore.keys import chain_keys
from kvstore.moves import Moves, RoomWaiters
from kvstore.store import BlockStore, Namespace, Plan

IDENT = make_identity()
SLOT = IDENT.block_bytes


def _keys(ns: Namespace, i: int, n: int = 1) -> list[bytes]:
    return chain_keys(ns.id, [i * 1000 + t for t in range(n * IDENT.block_tokens)],
                      IDENT.block_tokens)


def test_room_wakes_the_oldest_waiter_and_a_retry_keeps_its_place() -> None:
    async def run() -> list[str]:
        room = RoomWaiters()
        woke: list[str] = []
        first, second = room.ticket(), room.ticket()

        async def waiter(name: str, ticket: int) -> None:
            if await room.wait(asyncio.get_running_loop().time() + 5, ticket):
                woke.append(name)

        # the later ticket starts waiting first; the older one still goes first
        tasks = [asyncio.create_task(waiter("second", second))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(waiter("first", first)))
        tasks.append(asyncio.create_task(waiter("fresh", room.ticket())))
        await asyncio.sleep(0)
        assert len(room) == 3
        for expected in (["first"], ["first", "second"], ["first", "second", "fresh"]):
            room.freed()                     # one wake-up, one waiter: the oldest
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert woke == expected
        await asyncio.gather(*tasks)
        assert len(room) == 0
        room.freed()                         # nobody waits: nothing happens
        return woke

    assert asyncio.run(run()) == ["first", "second", "fresh"]


def test_a_waiter_that_gave_up_is_skipped() -> None:
    async def run() -> bool:
        room = RoomWaiters(asyncio.get_running_loop().time)
        now = asyncio.get_running_loop().time()
        assert not await room.wait(now + 0.01, room.ticket())   # the oldest times out
        later = asyncio.create_task(room.wait(now + 5))
        await asyncio.sleep(0)
        room.freed()                                           # wakes the live one
        return await later

    assert asyncio.run(run())


def test_room_wait_ends_at_its_deadline() -> None:
    async def run() -> tuple[bool, bool]:
        room = RoomWaiters(asyncio.get_running_loop().time)
        now = asyncio.get_running_loop().time()
        late = await room.wait(now - 1)            # passed already: at once
        timed_out = await room.wait(now + 0.05)    # nobody frees room
        return late, timed_out

    assert asyncio.run(run()) == (False, False)


def _ssd_store() -> tuple[BlockStore, Namespace]:
    store = BlockStore(4 * SLOT, 4 * SLOT, ssd_capacity=8 * SLOT, ssd_slab_bytes=4 * SLOT)
    ns = store.open_namespace(IDENT)
    for i in range(4):
        keys = _keys(ns, i)
        r = store.reserve("engine", ns, keys, None, 0.0)
        assert not isinstance(r, Plan)
        store.commit("engine", r.id, 0.0)
    return store, ns


def test_a_demotion_plan_that_never_runs_leaves_its_victims_as_they_were() -> None:
    store, ns = _ssd_store()
    plan = store.reserve("engine", ns, _keys(ns, 9), None, 0.0)  # full: a write first
    assert isinstance(plan, Plan) and len(plan.demote) == 1
    victim = plan.demote[0]
    assert victim.demoting
    Moves(store, lambda: 0.0).abandon(plan)
    assert not victim.demoting and victim.offset is not None
    store.check_invariants()
    assert victim in set(store.drams[""].policy(ns.cls).evictable())  # back on the order
    again = store.reserve("engine", ns, _keys(ns, 9), None, 0.0)
    assert isinstance(again, Plan) and len(again.demote) == 1
    Moves(store, lambda: 0.0).abandon(again)
    store.check_invariants()


def test_a_promotion_plan_that_never_runs_gives_its_slots_back() -> None:
    store, ns = _ssd_store()
    block = ns.blocks[_keys(ns, 0)[0]]
    t, _ = store.ssd_copies.reserve([block])      # an SSD copy, then DRAM lets it go
    store.ssd_copies.finish_write(t, [object()])
    store.drop_dram_copy(block)
    assert block.offset is None and block.ssd_offset is not None
    plan = store.acquire("reader", ns, [block.key], 0.0)
    assert isinstance(plan, Plan) and plan.promote is not None
    assert block.promoting and store.reserved_slots == 1
    Moves(store, lambda: 0.0).abandon(plan)
    assert not block.promoting and store.reserved_slots == 0 and not store.transfers
    assert block.ssd_offset is not None           # still on SSD, not counted as corrupt
    assert store.counters.checksum_failures == 0
    store.check_invariants()
    # acquired without promoting (the remote tier's write-through does so): nothing moves
    held = store.acquire("reader", ns, [block.key], 0.0, promote=False)
    assert isinstance(held, Plan) and held.promote is None and not held.demote
    assert not block.promoting and store.reserved_slots == 0


class RefusingSsd:
    """An SSD mover whose tier has no room (its store refuses every write), as when the
    SSD tier is full of another size class's copies it may not evict."""

    write_through = False

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.writes = 0

    async def write(self, blocks: list[Block], evict: bool = True) -> None:
        self.writes += 1
        self.store.ssd_copies.abort_demotion(blocks)
        raise CapacityError("the ssd tier has no room for them")


def test_an_ssd_tier_without_room_refuses_the_plan_and_stops_writing_ahead() -> None:
    store, ns = _ssd_store()
    ssd = RefusingSsd(store)
    moves = Moves(store, lambda: 0.0, ssd=ssd)  # type: ignore[arg-type]
    plan = store.reserve("engine", ns, _keys(ns, 9), None, 0.0)
    assert isinstance(plan, Plan) and plan.demote
    with pytest.raises(CapacityError, match="no room"):
        asyncio.run(moves.carry_out(plan))      # told, not swallowed: no endless re-plan
    assert not any(b.demoting for b in plan.demote)
    store.check_invariants()

    async def ahead() -> None:
        moves._writing_back = True
        await asyncio.wait_for(moves._write_back_ahead(), 2)  # stops at the refusal

    before = ssd.writes
    asyncio.run(ahead())
    assert ssd.writes == before + 1 and not moves._writing_back


def test_a_call_that_takes_a_slab_a_turn_lets_the_loop_run_and_outlasts_its_rounds() -> None:
    """An internal call (a fetch, a prefetch's promotion) whose room needs more slabs
    than it may make rounds (16): each slab is a plan of a turn, in which the loop runs
    other tasks, and none of them counts as a round (the call failed past 15 slabs when
    each slab was a round; before, all were taken in one turn, the loop held)."""
    slab = 2 * SLOT  # two blocks of IDENT to a slab; 20 slabs, each of IDENT's blocks
    store = BlockStore(20 * slab, slab)
    ns = store.open_namespace(IDENT)
    for i in range(40):
        r = store.reserve("engine", ns, _keys(ns, i), None, 0.0)
        store.commit("engine", r.id, 0.0)
    small = store.open_namespace(make_identity(model="small", head_dim=IDENT.head_dim // 4))
    per = small.cls.slots_per_slab  # (its slots are a quarter of IDENT's, or more)
    keys = _keys(small, 50_000, per * 18 + 1)  # 19 slabs
    moves = Moves(store, lambda: 0.0)

    async def run() -> tuple[object, int]:
        ran = 0

        async def other() -> None:
            nonlocal ran
            while True:
                ran += 1
                await asyncio.sleep(0)

        beside = asyncio.create_task(other())
        await asyncio.sleep(0)
        before = ran
        try:
            got = await moves.settle(lambda: store.reserve("engine", small, keys, None, 0.0))
        finally:
            beside.cancel()
        return got, ran - before

    got, ran = asyncio.run(run())
    assert not isinstance(got, Plan) and len(got.offsets) == len(keys)
    assert store.counters.slab_turns == 18 and len(small.cls.slabs) == 19
    assert ran >= 18  # the loop ran the other task in each turn
    assert store.drams[""].pool.earmarked(small.cls) == 0
    store.check_invariants()
