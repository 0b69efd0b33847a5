"""Slabs handed between block sizes in one DRAM tier (``kvstore.slab_moves``): a size
that arrives when another fills the tier is not refused, the slabs follow the sizes'
use, a slab with a block in use is never emptied, and the blocks moved keep their
bytes (copied into the arena's other slots) and every invariant."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from kvtest import make_identity

from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.plans import Plan
from kvstore.slab_moves import SlabMoves
from kvstore.store import Block, BlockStore, Namespace

A = make_identity(model="model-a", head_dim=128)  # 32 KiB blocks: 8 to a slab
B = make_identity(model="model-b", head_dim=64)   # 16 KiB blocks: 16 to a slab
SLAB = 256 << 10
SLABS = 4


def content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


class Arena:
    """A store over a bytearray as its DRAM arena, each block written with bytes that
    follow from its key."""

    def __init__(self, **kw: object) -> None:
        self.bytes = bytearray(SLABS * SLAB)
        self.store = BlockStore(SLABS * SLAB, SLAB, **kw)  # type: ignore[arg-type]
        self.store.move_bytes = self._move

    def _move(self, ns: Namespace, source: int, target: int) -> None:
        n = ns.block_bytes
        self.bytes[target:target + n] = self.bytes[source:source + n]

    def put(self, ns: Namespace, first: int, chains: int, length: int = 1,
            now: float = 0.0) -> list[bytes]:
        """``chains`` chains of ``length`` blocks, each written and committed."""
        keys: list[bytes] = []
        tokens = ns.identity.block_tokens
        for c in range(first, first + chains):
            chain = chain_keys(ns.id, list(range(c * 1000, c * 1000 + tokens * length)), tokens)
            r = self.store.reserve(ns.tenant, ns, chain, None, now)
            for key, offset in zip(chain, r.offsets):
                self.bytes[offset:offset + ns.block_bytes] = content(key, ns.block_bytes)
            self.store.commit(ns.tenant, r.id, now)
            keys += chain
        return keys

    def check(self, ns: Namespace) -> int:
        """Every cached block of ``ns`` reads its own bytes; how many there are."""
        n = 0
        for key, b in ns.blocks.items():
            if b.offset is not None:
                got = bytes(self.bytes[b.offset:b.offset + ns.block_bytes])
                assert got == content(key, ns.block_bytes), f"block {key.hex()} moved wrong"
                n += 1
        self.store.check_invariants()
        return n


def slabs(ns: Namespace) -> int:
    return len(ns.cls.slabs)


def test_a_new_block_size_gets_a_slab_in_a_tier_another_size_filled() -> None:
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    keys = arena.put(a, 0, 32)  # 32 blocks of 32 KiB: all four slabs
    assert store.drams[""].pool.empty_slabs == 0 and slabs(a) == SLABS
    warm = keys[1::2]  # every other block hit: the coldest lie in every slab
    assert store.lookup(a, warm[:1]) and all(store.lookup(a, [k]) for k in warm)
    arena.put(b, 100, 1)  # refused until this change ("0 evictable in the dram tier")
    assert slabs(b) == 1 and slabs(a) == SLABS - 1
    stats = store.stats()
    assert stats["slab_moves"] == 1 and stats["reserved_slots"] == 0
    # the slab given away kept its warm blocks: copied into slots the coldest left
    assert stats["slab_moved_blocks"] == 4
    assert arena.check(a) == 3 * 8 and arena.check(b) == 1
    assert all(a.blocks[k].offset is not None for k in warm)


def test_the_slabs_follow_each_sizes_use_and_do_not_go_back_and_forth() -> None:
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    arena.put(a, 0, 32)
    for i in range(30):  # b's traffic now: a's blocks go cold, and its slabs to b
        arena.put(b, 100 + 8 * i, 8)
    assert slabs(b) == SLABS - 1 and slabs(a) == 1  # a keeps one: one slab of slack
    moves = store.counters.slab_moves
    for i in range(30):  # more of the same moves nothing
        arena.put(b, 1000 + 8 * i, 8)
    assert store.counters.slab_moves == moves
    for i in range(60):  # a's turn: its share comes back
        arena.put(a, 2000 + 4 * i, 4)
    assert slabs(a) == SLABS - 1 and slabs(b) == 1
    arena.check(a), arena.check(b)


def test_both_sizes_busy_share_the_slabs_by_their_use() -> None:
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    for i in range(80):  # a third of the bytes asked for are b's
        arena.put(a, 10 * i, 2)
        arena.put(b, 100_000 + 10 * i, 2)  # (16 KiB: half the bytes of a's two)
    assert slabs(a) == 3 and slabs(b) == 1
    arena.check(a), arena.check(b)


def test_a_slab_with_a_block_in_use_is_never_emptied() -> None:
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    keys = arena.put(a, 0, 32)
    by_slab = {}
    for key in keys:
        by_slab.setdefault(a.blocks[key].offset // SLAB, key)  # type: ignore[operator]
    assert len(by_slab) == SLABS
    for key in by_slab.values():  # a pin in every slab
        store.acquire("reader", a, [key], 0.0)
    rejects = store.counters.capacity_rejects
    with pytest.raises(CapacityError):
        arena.put(b, 100, 1)
    stats = store.stats()
    assert stats["slab_moves"] == 0 and stats["reserved_slots"] == 0
    assert store.counters.capacity_rejects == rejects + 1  # the request's, once
    assert arena.check(a) == 32 and not b.blocks
    store.drop_owner("reader")  # the pins go: the next request gets its slab
    arena.put(b, 100, 1)
    assert slabs(b) == 1 and arena.check(b) == 1 and arena.check(a) == 24


def test_a_reservation_in_a_slab_keeps_it_until_committed() -> None:
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    arena.put(a, 0, 24)  # three slabs full; the fourth gets one block and a reservation
    arena.put(a, 24, 1)
    held = store.reserve("writer", a, chain_keys(a.id, list(range(99_000, 99_016)), 16),
                         None, 0.0)
    arena.put(a, 25, 6)  # the fourth slab full too
    arena.put(b, 100, 1)  # not from the slab with the reservation in it
    slab_of_held = held.offsets[0] // SLAB
    assert slab_of_held in a.cls.slabs
    store.abort("writer", held.id)
    arena.check(a), arena.check(b)


def test_a_tenant_over_its_share_takes_a_slab_of_its_own_blocks_only() -> None:
    """Tenant weights hold across sizes: a tenant past its share of the tier takes a slab
    for its new size from its own blocks of another size (it switched models, say), never
    one of another tenant's (whose blocks would go for it); one under its share may."""
    arena = Arena()
    store = arena.store
    mine = store.open_namespace(make_identity(model="model-a", head_dim=128, tenant="t1"))
    a_keys = arena.put(mine, 0, 24)  # three of four slabs: t1 holds 3/4 of the tier
    other = store.open_namespace(make_identity(model="model-a", head_dim=128, tenant="t2"))
    arena.put(other, 100, 8)  # the fourth
    small = store.open_namespace(make_identity(model="model-b", head_dim=64, tenant="t1"))
    by_slab: dict[int, bytes] = {}
    for key in a_keys:
        by_slab.setdefault(mine.blocks[key].offset // SLAB, key)  # type: ignore[operator]
    for key in by_slab.values():  # a pin in each of t1's slabs: none of its own can go
        store.acquire("reader", mine, [key], 0.0)
    with pytest.raises(CapacityError):
        arena.put(small, 200, 1)  # t1, over its half, would take a slab of t2's blocks
    assert store.counters.slab_moves == 0 and arena.check(other) == 8
    store.drop_owner("reader")
    arena.put(small, 200, 1)  # a slab of t1's own blocks
    assert store.counters.slab_moves == 1 and slabs(small) == 1
    assert arena.check(other) == 8 and arena.check(mine) == 16
    guest = store.open_namespace(make_identity(model="model-c", head_dim=32, tenant="t3"))
    arena.put(guest, 300, 1)  # t3 holds nothing: under its share, from anyone
    assert store.counters.slab_moves == 2 and slabs(guest) == 1
    arena.check(mine), arena.check(other), arena.check(guest), arena.check(small)


def to_ssd(store: BlockStore, blocks: list[Block]) -> list[tuple[bytes, bytes]]:
    """Write ``blocks`` to the SSD tier (as a demotion's write would, without bytes)."""
    t, removed = store.ssd_copies.reserve(blocks)
    store.ssd_copies.finish_write(t, [object()] * len(blocks))
    return removed


def test_a_size_with_no_ssd_slab_takes_one_another_size_filled() -> None:
    """The SSD tier's slabs all a's: b's blocks are written there once a slab of a's
    is emptied, the one whose copies are all of blocks still in DRAM first."""
    arena = Arena(ssd_capacity=SLABS * SLAB, ssd_slab_bytes=SLAB)
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    a_keys = arena.put(a, 0, 16, length=2)  # 16 chains of two: every DRAM slab a's
    assert not to_ssd(store, [a.blocks[k] for k in a_keys])  # and every SSD slab
    assert store.ssd is not None and store.ssd.pool.empty_slabs == 0
    for k in a_keys[:16]:  # the first eight chains leave DRAM: on SSD alone
        store.drop_dram_copy(a.blocks[k])
    b_keys = arena.put(b, 100, 1)
    removed = to_ssd(store, [b.blocks[k] for k in b_keys])  # refused before: no slab
    stats = store.ssd_copies.stats()
    assert stats["slab_moves"] == 1 and len(removed) == stats["slab_dropped"] == 8
    assert b.blocks[b_keys[0]].ssd_offset is not None
    # the slab emptied held copies of blocks still in DRAM: nothing left the cache
    assert all(a.blocks[k].present for k in a_keys)
    store.check_invariants()


def test_an_ssd_slab_is_not_emptied_under_a_block_being_written() -> None:
    """b starved on SSD while a's block is written with it: a slab whose dropping would
    take that block too (its SSD-only parent there) is not emptied; once it is not being
    written, a slab of copies of blocks still in DRAM is."""
    arena = Arena(ssd_capacity=2 * SLAB, ssd_slab_bytes=SLAB)
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    chains = arena.put(a, 0, 8, length=2)  # 8 chains of two
    heads, tails = chains[0::2], chains[1::2]
    fillers = arena.put(a, 100, 8)
    assert not to_ssd(store, [a.blocks[k] for k in heads + fillers])  # both SSD slabs
    for k in heads:  # on SSD alone; their tails in DRAM alone
        store.drop_dram_copy(a.blocks[k])
    (b_key,) = arena.put(b, 200, 1)
    tail, fresh = a.blocks[tails[0]], b.blocks[b_key]
    with pytest.raises(CapacityError):  # the heads' slab would take ``tail`` with it
        store.ssd_copies.reserve([tail, fresh])
    assert tail.offset is not None and all(a.blocks[k].ssd_offset is not None for k in heads)
    assert store.ssd_copies.stats()["slab_moves"] == 0
    store.check_invariants()
    copies = sum(a.blocks[k].ssd_offset is not None for k in fillers)  # (7: one went
    removed = to_ssd(store, [fresh])  # for tail) the fillers' slab: blocks in DRAM too
    assert store.ssd_copies.stats()["slab_moves"] == 1 and fresh.ssd_offset is not None
    assert len(removed) == copies and all(a.blocks[k].offset is not None for k in fillers)
    store.check_invariants()


@pytest.mark.parametrize("read", ["lookup", "acquire"])
def test_a_size_hit_keeps_its_slabs_however_it_is_read(read: str) -> None:
    """Hits count towards a size's share whether found by lookup or read by acquire (a
    get): a hot size keeps its slabs against one that writes blocks never read again."""
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    hot = arena.put(a, 0, 24)  # three slabs
    for i in range(200):
        for k in hot:
            if read == "lookup":
                store.lookup(a, [k])
            else:
                store.release("reader", store.acquire("reader", a, [k], 0.0).id)
        arena.put(b, 10_000 + i, 1)
    assert slabs(a) == 3 and all(a.blocks[k].offset is not None for k in hot)
    arena.check(a), arena.check(b)


def settle(store: BlockStore, call: Callable[[], object]) -> object:
    """A store call with its plans carried out in-process, as the daemon's moves would:
    demotions written at once; one the SSD tier has no room for fails the call."""
    for _ in range(16):
        got = call()
        if not isinstance(got, Plan):
            return got
        if got.demote:
            try:
                t, _ = store.ssd_copies.reserve(got.demote)
            except CapacityError:
                store.ssd_copies.abort_demotion(got.demote)
                raise
            store.ssd_copies.finish_write(t, [object()] * len(t.blocks))
    raise CapacityError("blocks kept moving between tiers; try again")


def test_an_ssd_tier_of_one_slab_leaves_no_request_waiting_for_writes_it_refuses() -> None:
    """The SSD tier's one slab a's: b's blocks cannot be written there, so they leave
    DRAM as if there were no SSD tier, and a's requests, under their share, never wait
    on b's demotions (each failed, and was planned again, for good)."""
    store = BlockStore(SLABS * SLAB, SLAB, ssd_capacity=SLABS * SLAB,
                       ssd_slab_bytes=SLABS * SLAB)
    a, b = store.open_namespace(A), store.open_namespace(B)

    def put(ns: Namespace, first: int, blocks: int) -> list[bytes]:
        tokens = ns.identity.block_tokens
        keys = chain_keys(ns.id, list(range(first, first + blocks * tokens)), tokens)
        r = settle(store, lambda: store.reserve("w", ns, keys, None, 0.0))
        store.commit("w", r.id, 0.0)  # type: ignore[attr-defined]
        return keys

    a_keys = [k for i in range(40) for k in put(a, 1000 * i, 1)]  # DRAM and SSD a's
    put(b, 5_000_000, 32)  # b starved: two slabs of a's
    assert slabs(b) == 2
    for _ in range(20):
        for k in a_keys:
            if a.blocks[k].offset is not None:
                store.lookup(a, [k])
    for i in range(5):  # a, under its share now, takes b's slabs back: b's blocks drop
        put(a, 9_000_000 + 1000 * i, 1)
    assert slabs(a) >= 3
    store.check_invariants()


def test_a_request_short_of_several_slabs_takes_one_a_turn_and_no_one_else_takes_them() -> None:
    """A request that needs several slabs takes one each time it is made, answered in
    between with a plan of a turn (the loop serves others: one reserve of fifteen held
    it 190 ms), the slabs emptied for it set aside for its size: the donor's own next
    write between the turns evicts its own blocks rather than take them back (with a
    slab left free for a later turn, a request of three slabs never fit)."""
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    pool = store.drams[""].pool
    arena.put(a, 0, 32)
    keys = chain_keys(b.id, list(range(16 * 40)), 16)  # 40 blocks of 16 KiB: three slabs
    turns = 0
    while isinstance(r := store.reserve("w", b, keys, None, 0.0), Plan):
        assert r.turn and not (r.demote or r.to_remote or r.promote or r.reads), r
        turns += 1
        assert store.counters.slab_moves == turns and pool.empty_slabs == turns
        assert pool.earmarked(b.cls) == turns == sum(n for _, _, n in r.earmarks)
        store.check_invariants()
        arena.put(a, 1000 * turns, 8)  # the donor's next write: of its own slabs
        assert pool.empty_slabs == turns and slabs(a) == SLABS - turns
        r.let_go()  # what carrying the plan out does, just before the call is made again
        assert pool.earmarked(b.cls) == 0
    assert turns == 2 and store.counters.slab_turns == 2
    assert slabs(b) == 3 and store.counters.slab_moves == 3 and pool.empty_slabs == 0
    store.abort("w", r.id)
    arena.check(a)


def test_a_request_gone_between_its_turns_leaves_no_slab_set_aside() -> None:
    """A request given up after a turn (its client gone, the plan abandoned) lets the
    slabs set aside for it go: the next request of any size takes them."""
    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    pool = store.drams[""].pool
    arena.put(a, 0, 32)
    keys = chain_keys(b.id, list(range(16 * 40)), 16)
    plan = store.reserve("w", b, keys, None, 0.0)
    assert isinstance(plan, Plan) and plan.turn and pool.earmarked(b.cls) == 1
    plan.let_go()
    plan.let_go()  # (once: a second call lets nothing more go)
    assert pool.earmarked(b.cls) == 0 and pool.empty_slabs == 1
    arena.put(a, 5000, 1)  # a's next block takes the empty slab before evicting its own
    assert pool.empty_slabs == 0 and slabs(a) == SLABS
    arena.check(a)


def test_the_slabs_set_aside_are_counted_in_what_each_size_may_take() -> None:
    """The pool's own bookkeeping: a slab set aside for one class is available to it,
    not to another; a class's allocation takes its own first; never more set aside
    than there are empty slabs."""
    from kvstore.pool import SlabPool

    pool = SlabPool(4 * SLAB, SLAB)
    big, small = pool.class_for(32 << 10), pool.class_for(16 << 10)
    assert pool.earmark(small, 3) == 3 and pool.earmark(big, 5) == 1  # 4 empty in all
    assert pool.available(small) == 3 * 16 and pool.available(big) == 8
    assert pool.allocate(big, 9) is None and pool.allocate(big, 8) is not None
    assert pool.earmarked(big) == 0 and pool.empty_for(big) == 0
    assert pool.allocate(small, 17) is not None and pool.earmarked(small) == 1
    pool.release(small, 3)  # (more than is left: what is left)
    assert pool.earmarked(small) == 0 and pool.empty_for(big) == 1
    pool.check()


def test_a_batch_waiting_for_a_slab_keeps_those_its_aborted_items_emptied() -> None:
    """A batch's later item waits a turn for a slab; its earlier items' reservations are
    aborted meanwhile (all or none), emptying the slab they had taken: it is set aside
    with the turn's (``set_aside``), so another size's write between the turns leaves
    it (it went to whichever size asked first)."""
    from kvstore.slab_moves import set_aside

    arena = Arena()
    store = arena.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    pool = store.drams[""].pool
    arena.put(a, 0, 32)
    first = store.reserve("w", b, chain_keys(b.id, list(range(16 * 8)), 16), None, 0.0)
    assert not isinstance(first, Plan) and slabs(b) == 1  # 8 of 16 slots: one slab
    second = chain_keys(b.id, list(range(10**6, 10**6 + 16 * 36)), 16)  # two more slabs
    turn = store.reserve("w", b, second, None, 0.0)
    assert isinstance(turn, Plan) and turn.turn and pool.earmarked(b.cls) == 1
    store.abort("w", first.id)  # (the batch's all or none)
    assert slabs(b) == 0 and pool.empty_slabs == 2
    set_aside(turn, pool, b.cls, 8 + 36)
    assert pool.earmarked(b.cls) == 2 and sum(n for _, _, n in turn.earmarks) == 2
    arena.put(a, 7000, 4)  # another size's writes between the turns: its own slots
    assert pool.empty_slabs == 2
    turn.let_go()
    first = store.reserve("w", b, chain_keys(b.id, list(range(16 * 8)), 16), None, 0.0)
    again = store.reserve("w", b, second, None, 0.0)
    assert not isinstance(first, Plan) and not isinstance(again, Plan) and slabs(b) == 3
    arena.check(a)


def test_a_starved_size_takes_a_slab_of_another_when_the_furthest_over_its_share_has_none() -> None:
    """The class furthest over its share has every block pinned; a third class has
    slabs of cold blocks: a starved request takes one of those (only the first donor
    was tried, and the request refused though another class could give a slab)."""
    c_ident = make_identity(model="model-c", head_dim=32)  # 8 KiB blocks: 32 to a slab
    arena = Arena()
    store = arena.store
    a, b, c = (store.open_namespace(i) for i in (A, B, c_ident))
    held = arena.put(a, 0, 16)  # two slabs of a, every block pinned
    pin = store.acquire("reader", a, held, 0.0)
    assert not isinstance(pin, Plan)
    cold = arena.put(c, 0, 64)  # two slabs of c
    for _ in range(10):  # c much used since: a is the furthest over its share
        for k in cold:
            store.lookup(c, [k])
    shares = SlabMoves.shares_of(store.drams[""])
    assert len(a.cls.slabs) - shares[a.cls] > len(c.cls.slabs) - shares[c.cls]
    keys = chain_keys(b.id, list(range(16 * 20)), 16)  # 20 blocks of 16 KiB: two slabs
    turns = 0
    while isinstance(r := store.reserve("w", b, keys, None, 0.0), Plan):
        assert r.turn
        r.let_go()
        turns += 1
    assert turns == 1 and slabs(b) == 2 and slabs(a) == 2 and slabs(c) == 0
    assert all(a.blocks[k].offset is not None for k in held)  # the pinned stay put
    store.abort("w", r.id)
    arena.check(a)


@pytest.mark.parametrize("slab_count, asks, served", [
    (4, [("b", 48), ("c", 64)], ["served", "refused"]),  # room for one: the first
    (8, [("b", 48), ("c", 96)], ["served", "served"]),   # room for both: both
])
def test_two_sizes_starved_at_once_take_their_slabs_first_come(
        slab_count: int, asks: list[tuple[str, int]], served: list[str]) -> None:
    """Two requests of two sizes, each needing several slabs of a third size's, made
    at once (as two clients' requests are, through the mover pipeline): the later waits
    its turns out while the first takes its slabs a turn at a time.  Taking slabs by
    turns with it, the later took what the first needed and the first was refused
    where only one could be served (and with room for both, one was refused too)."""
    import asyncio

    from kvstore.moves import Moves

    c_ident = make_identity(model="model-c", head_dim=32)  # 8 KiB blocks: 32 to a slab
    arena = Arena()
    arena.bytes = bytearray(slab_count * SLAB)
    store = arena.store = BlockStore(slab_count * SLAB, SLAB)
    store.move_bytes = arena._move
    names = {"a": store.open_namespace(A), "b": store.open_namespace(B),
             "c": store.open_namespace(c_ident)}
    arena.put(names["a"], 0, 8 * slab_count)  # every slab a's
    moves = Moves(store, lambda: 0.0)
    outcome: list[str] = ["", ""]

    async def ask(i: int, name: str, blocks: int) -> None:
        ns = names[name]
        keys = chain_keys(ns.id, list(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * blocks)), 16)
        try:
            await moves.settle(lambda: store.reserve(f"owner{i}", ns, keys, None, 0.0))
            outcome[i] = "served"
        except CapacityError:
            outcome[i] = "refused"

    async def both() -> None:
        await asyncio.gather(*(ask(i, name, n) for i, (name, n) in enumerate(asks)))

    asyncio.run(both())
    assert outcome == served
    assert store.drams[""].pool.earmarked_elsewhere(names["a"].cls) == 0
    arena.check(names["a"])


def test_a_turn_waited_out_takes_and_sets_aside_nothing() -> None:
    """While one size's request takes its slabs a turn at a time, another starved size's
    request is answered with a turn it waits out: no slab taken, none set aside (a batch
    sets aside the slabs its aborted items emptied only after a slab taken, so two
    batches waiting never hold slabs aside from each other)."""
    c_ident = make_identity(model="model-c", head_dim=32)
    arena = Arena()
    store = arena.store
    a, b, c = (store.open_namespace(i) for i in (A, B, c_ident))
    pool = store.drams[""].pool
    arena.put(a, 0, 32)
    first = store.reserve("w", b, chain_keys(b.id, list(range(16 * 40)), 16), None, 0.0)
    assert isinstance(first, Plan) and first.turn and first.earmarks
    moves = store.counters.slab_moves
    wait = store.reserve("v", c, chain_keys(c.id, list(range(16 * 40)), 16), None, 0.0)
    assert isinstance(wait, Plan) and wait.turn and not wait.earmarks
    assert store.counters.slab_moves == moves and pool.earmarked(c.cls) == 0
    first.let_go()
    store.check_invariants()


def _slab_of(pool_slab_bytes: int, block: Block) -> int:
    assert block.offset is not None
    return block.offset // pool_slab_bytes


def stepped(monkeypatch: pytest.MonkeyPatch, step: int) -> tuple[Arena, Namespace, Namespace]:
    """A store over an arena whose slabs move ``step`` blocks a turn, and a
    namespace of each size (``A``'s fill it, ``B``'s take its slabs)."""
    import kvstore.slab_moves as slab_moves

    monkeypatch.setattr(slab_moves, "STEP_BLOCKS", step)
    arena = Arena()
    return arena, arena.store.open_namespace(A), arena.store.open_namespace(B)


def test_a_big_slab_is_emptied_a_step_a_turn_and_its_room_held_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slab of more blocks than a step is emptied over several turns, each call
    evicting and copying at most a step (a 64 MiB slab of 16 KiB blocks in one call held
    the loop 8.6-9.3 ms): between the calls the slab is drained (no slot of it handed
    out) and the room made for its blocks held, so the donor's own writes evict their
    own rather than fill either; another starved size waits its turns out; every block
    keeps its bytes and every invariant holds between the turns."""
    c_ident = make_identity(model="model-c", head_dim=32)  # 8 KiB blocks
    arena, a, b = stepped(monkeypatch, 3)
    store = arena.store
    c = store.open_namespace(c_ident)
    pool = store.drams[""].pool
    keys = arena.put(a, 0, 32)
    for k in keys[1::2]:
        store.lookup(a, [k])
    want = chain_keys(b.id, list(range(16)), 16)
    turns = placed = 0
    while isinstance(r := store.reserve("w", b, want, None, 0.0), Plan):
        assert r.turn and len(r.drains) == 1, r
        turns += 1
        (_, donor, slab) = r.drains[0]
        assert donor is a.cls and slab.draining and pool.draining() == 1
        store.check_invariants()
        # the donor's own write meanwhile: into none of the slab, nor of the room held
        before = (slab.used, store.counters.slab_moved_blocks)
        evictions = store.counters.evictions
        written = arena.put(a, 1000 + turns, 1)
        assert store.counters.evictions == evictions + 1 and slab.used <= before[0]
        if slab.draining:  # (its own victim in the slab, no room held: the slab is its)
            assert _slab_of(SLAB, a.blocks[written[0]]) != slab.index
            placed += 1
        # another starved size waits its turn: nothing taken, nothing moved
        wait = store.reserve("v", c, chain_keys(c.id, list(range(16 * 40)), 16), None, 0.0)
        assert isinstance(wait, Plan) and wait.turn and not (wait.earmarks or wait.drains)
        assert store.counters.slab_moved_blocks == before[1]
        wait.let_go()
        r.let_go()  # what carrying the plan out does, just before the call is made again
        assert not slab.draining
        arena.check(a)
    assert turns >= 3 and placed >= 1 and store.counters.slab_turns == turns
    assert slabs(b) == 1 and store.counters.slab_moves == 1
    store.abort("w", r.id)
    arena.check(a)


def test_each_step_of_a_slab_evicts_and_copies_at_most_a_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of a slab's move does at most a step of evictions and a step of copies,
    and all its calls together what the move in one go did."""
    arena, a, b = stepped(monkeypatch, 3)
    store = arena.store
    keys = arena.put(a, 0, 32)
    for k in keys[1::2]:
        store.lookup(a, [k])
    want = chain_keys(b.id, list(range(16)), 16)
    steps = []
    while True:
        counts = (store.counters.evictions, store.counters.slab_moved_blocks)
        r = store.reserve("w", b, want, None, 0.0)
        steps.append((store.counters.evictions - counts[0],
                      store.counters.slab_moved_blocks - counts[1]))
        if not isinstance(r, Plan):
            break
        r.let_go()
    assert all(e <= 3 and m <= 3 for e, m in steps), steps
    # as in one go: a slab's worth of the coldest evicted, the slab's warm blocks moved
    assert sum(e for e, _ in steps) == 8 and sum(m for _, m in steps) == 4
    assert len(steps) >= 4
    assert slabs(b) == 1
    store.abort("w", r.id)
    arena.check(a)


def test_a_request_gone_between_steps_gives_the_slab_and_its_room_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request given up while its slab is half emptied (its plan let go, never made
    again) leaves the slab and the room held for it to the donor: its next writes take
    those slots rather than evict."""
    arena, a, b = stepped(monkeypatch, 3)
    store = arena.store
    pool = store.drams[""].pool
    keys = arena.put(a, 0, 32)
    for k in keys[1::2]:  # (the coldest in every slab: the slab's others are moved)
        store.lookup(a, [k])
    want = chain_keys(b.id, list(range(16)), 16)
    plans = []
    while (r := store.reserve("w", b, want, None, 0.0)) is not None and isinstance(r, Plan):
        plans.append(r)
        if r.drains and store.counters.slab_moved_blocks:
            break  # blocks moved out, the slab not yet empty
        r.let_go()
    assert plans[-1].drains and pool.available(a.cls) == 0
    plans[-1].let_go()
    free = pool.available(a.cls)
    assert free > 0 and not pool.draining()
    evictions = store.counters.evictions
    arena.put(a, 5000, free)
    assert store.counters.evictions == evictions and pool.available(a.cls) == 0
    arena.check(a)


def test_a_block_pinned_between_steps_is_never_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of the slab being emptied pinned between two steps (a client reads it)
    stays where it is while pinned: the next step leaves that slab for another."""
    arena, a, b = stepped(monkeypatch, 3)
    store = arena.store
    arena.put(a, 0, 32)
    want = chain_keys(b.id, list(range(16)), 16)
    r = store.reserve("w", b, want, None, 0.0)
    while isinstance(r, Plan) and not (r.drains and r.drains[0][2].used < 8):
        r.let_go()
        r = store.reserve("w", b, want, None, 0.0)
    assert isinstance(r, Plan)
    slab = r.drains[0][2]
    r.let_go()
    held = next(blk for blk in a.blocks.values()
                if blk.offset is not None and _slab_of(SLAB, blk) == slab.index)
    offset = held.offset
    pin = store.acquire("reader", a, [held.key], 0.0)
    assert not isinstance(pin, Plan)
    while isinstance(r := store.reserve("w", b, want, None, 0.0), Plan):
        assert held.offset == offset
        r.let_go()
    assert held.offset == offset and slabs(b) == 1
    store.release("reader", pin.id)
    store.abort("w", r.id)
    arena.check(a)


def test_a_drained_slab_is_counted_apart_in_the_pool() -> None:
    """The pool's own bookkeeping of a slab being emptied: none of its slots, nor the
    class's other free slots (held for its blocks), handed out while it drains; the
    blocks moved out take those held first; a block of it that goes frees one held, or,
    none held, gives the slab back to the class; emptied, it goes to the tier with what
    was held; other classes see it drained for its class until its drain ends."""
    from kvstore.pool import SlabPool

    pool = SlabPool(4 * SLAB, SLAB)
    big = pool.class_for(32 << 10)
    first = pool.allocate(big, 8)
    second = pool.allocate(big, 4)  # a second slab, 4 of its 8 used
    assert first is not None and second is not None
    slab = big.slabs[first[0] // SLAB]
    pool.drain(big, slab)
    assert big.free_slots == 0 and pool.available(big) == 2 * 8  # the two empty slabs
    assert pool.draining() == 1
    pool.check()
    news = pool.move_out(big, slab, first[:2])  # into two of the four held
    assert all(n // SLAB != slab.index for n in news) and slab.used == 6
    assert big.free_slots == 0
    pool.free(big, first[2:4])  # two fewer to move: two held slots free
    assert big.free_slots == 2 and slab.used == 4 and slab.draining
    pool.check()
    pool.free(big, first[4:5])  # none held: the class made room for itself
    assert not slab.draining and big.free_slots == 2 + 5 and slab.used == 3
    assert pool.draining() == 1  # (until the drain's end)
    pool.check()
    pool.undrain(big, slab)
    assert big.free_slots == 7 and not pool.draining()
    pool.check()
    pool.drain(big, slab)  # 3 used, 2 held
    pool.move_out(big, slab, first[5:7])  # the two held
    assert big.free_slots == 0 and slab.used == 1
    pool.free(big, first[7:8])  # its last block gone: to the tier
    assert slab.index not in big.slabs and pool.empty_slabs == 3 and not slab.draining
    pool.undrain(big, slab)  # (gone to the tier: nothing more to give back)
    assert not pool.draining()
    pool.check()


def _chain(ns: Namespace, c: int, n: int) -> list[bytes]:
    t = ns.identity.block_tokens
    return chain_keys(ns.id, list(range(c * 1000, c * 1000 + t * n)), t)


def test_two_requests_never_drain_two_slabs_of_one_donor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second request while a slab of the donor drains waits its turn rather than
    drain another of its slabs (a second reader's finding: the second drain's count of
    slots held went negative, and the donor's next write took slots it did not have, 5
    of them lost for good)."""
    arena, a, b = stepped(monkeypatch, 2)
    store = arena.store
    pool = store.drams[""].pool
    keys = arena.put(a, 0, 32)  # 4 slabs of 8
    for k in keys[4:]:
        store.lookup(a, [k])  # the coldest: keys[0:4], in the first slab
    store.evict(a, keys[8:11])
    store.evict(a, keys[16:18])
    t = B.block_tokens
    r1 = store.reserve("w1", b, chain_keys(b.id, list(range(t)), t), None, 0.0)
    r2 = store.reserve("w2", b, chain_keys(b.id, list(range(99, 99 + t)), t), None, 0.0)
    assert isinstance(r1, Plan) and isinstance(r2, Plan)
    assert pool.draining() == 1 and not r2.drains
    store.check_invariants()
    r1.let_go()
    arena.put(a, 500, 1, pool.available(a.cls))
    r2.let_go()
    store.check_invariants()
    arena.check(a)


def test_a_donor_that_grows_while_a_slab_of_it_drains_fills_the_new_slab(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The donor's write that takes an empty slab while a slab of it drains takes the
    new slab's slots, not those held for the drain (a second reader's finding: the
    new slab was kept empty, which no other size could then take)."""
    c_ident = make_identity(model="model-c", head_dim=32)
    arena, a, b = stepped(monkeypatch, 2)
    store = arena.store
    c = store.open_namespace(c_ident)
    keys = arena.put(a, 0, 20)  # two slabs full, a third of 4
    t = c_ident.block_tokens
    held = store.reserve("h", c, chain_keys(c.id, list(range(t)), t), None, 0.0)
    assert not isinstance(held, Plan)
    for k in keys[2:]:
        store.lookup(a, [k])
    tb = B.block_tokens
    r = store.reserve("w", b, chain_keys(b.id, list(range(tb)), tb), None, 0.0)
    assert isinstance(r, Plan) and r.drains
    store.abort("h", held.id)  # c's slab back to the tier
    arena.put(a, 900, 1)  # a grows into it
    store.check_invariants()
    r.let_go()
    store.check_invariants()


@pytest.mark.parametrize("step", [2, 512])  # (512: in one go)
def test_a_drain_holds_only_the_room_its_blocks_need(monkeypatch: pytest.MonkeyPatch,
                                                      step: int) -> None:
    """The donor's own request while a slab of it drains gets the free slots its
    blocks do not need, as it did while slabs moved in one go (a second reader's
    finding: every free slot of the donor was held, and a request of it refused)."""
    arena, a, b = stepped(monkeypatch, step)
    store = arena.store
    arena.put(a, 0, 1, 8)
    arena.put(a, 1, 1, 4)
    h1 = store.reserve("h", a, _chain(a, 2, 4), None, 0.0)
    arena.put(a, 3, 1, 5)
    h2 = store.reserve("h", a, _chain(a, 4, 3), None, 0.0)
    arena.put(a, 5, 1, 5)
    h3 = store.reserve("h", a, _chain(a, 6, 3), None, 0.0)
    for h in (h1, h2, h3):
        assert not isinstance(h, Plan)
        store.abort("h", h.id)  # a: 8, 4, 5, 5 used, 6 free beside the one of 4
    b_turn = store.reserve("w", b, _chain(b, 100, 1), None, 0.0)  # b takes a's slab of 4
    pin = store.acquire("reader", a, [k for k, x in a.blocks.items() if x.offset is not None],
                        0.0)
    assert not isinstance(pin, Plan)
    got = store.reserve("w2", a, _chain(a, 50, 2), None, 0.0)  # 6 - 4 = 2 spare either way
    assert not isinstance(got, Plan)
    if isinstance(b_turn, Plan):
        b_turn.let_go()
    store.check_invariants()


def test_a_batch_waiting_on_a_step_keeps_the_slab_its_aborted_items_emptied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A token plan whose later item waits on a step of a slab's move keeps the slab its
    earlier items' aborts emptied (a second reader's finding: it went to the donor's
    next write between the turns)."""
    from types import SimpleNamespace

    from kvstore import protocol as p
    from kvstore.verbs import reserve_batch

    arena, a, b = stepped(monkeypatch, 2)
    store = arena.store
    pool = store.drams[""].pool
    arena.put(a, 10, 24)
    d = SimpleNamespace(
        store=store, max_keys=10**6, clock=lambda: 0.0,
        sessions=SimpleNamespace(check_cap=lambda *x: None, check_grant_reserve=lambda *x: None),
        limits=SimpleNamespace(lease_seconds=30.0), moves=SimpleNamespace(freed=lambda: None))
    v = SimpleNamespace(d=d, _writable=lambda s, n: b, _check_keys=lambda k: None,
                        _tokens_wanted=lambda: False)
    bt = B.block_tokens
    req = p.ReserveBatch(1, b.id, [p.PlanItem(0, 2 * bt, _chain(b, 2, 2)),
                                   p.PlanItem(0, 16 * bt, _chain(b, 3, 16))])
    session = SimpleNamespace(id="batch", tenant=b.tenant)
    r = reserve_batch(v, session, req, [])  # type: ignore[arg-type]
    assert isinstance(r, Plan) and r.drains and pool.empty_slabs == 1
    arena.put(a, 500, 1)  # the donor's write between the turns
    assert pool.empty_slabs == 1
    r.let_go()
    store.check_invariants()
