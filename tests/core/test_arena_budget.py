"""One budget of slabs over per-tenant arenas (``kvstore.arena_budget``): the arenas
together hold at most ``capacity // slab_bytes`` slabs; a tenant at its share evicts its
own blocks, one below it takes a slab from the arena furthest over its share (weights
honoured), never one with a block pinned or reserved; a slab going back to the budget
is told to the daemon (its pages go back to the system); the blocks moved keep their
bytes, and every pool's and the store's invariants hold."""

from __future__ import annotations

import hashlib

import pytest
from kvtest import make_identity

from kvstore.arena_budget import ArenaBudget, budget_slab_bytes
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.plans import Plan
from kvstore.store import BlockStore, Namespace

A = make_identity(tenant="a")
B = make_identity(tenant="b")
C = make_identity(tenant="c")
SLOT = A.block_bytes  # 8 KiB
SLAB = 4 * SLOT
SLABS = 8


def content(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


class Arenas:
    """A store with an arena per tenant, each a bytearray; every block written with
    bytes that follow from its key."""

    def __init__(self, **kw: object) -> None:
        self.store = BlockStore(SLABS * SLAB, SLAB, per_tenant=True, **kw)  # type: ignore[arg-type]
        self.bytes: dict[str, bytearray] = {}
        self.store.move_bytes = self._move
        self.peak = 0  # the most slabs the arenas held at once, after each request

    def arena(self, tenant: str) -> bytearray:
        return self.bytes.setdefault(tenant, bytearray(SLABS * SLAB))

    def _move(self, ns: Namespace, source: int, target: int) -> None:
        data, n = self.arena(ns.tenant), ns.block_bytes
        data[target:target + n] = data[source:source + n]

    def slabs_held(self) -> int:
        return sum(len(t.pool._owner) for t in self.store.drams.values())

    def put(self, ns: Namespace, first: int, count: int, now: float = 0.0) -> list[bytes]:
        """``count`` one-block chains, each written and committed."""
        keys = []
        data = self.arena(ns.tenant)
        for i in range(first, first + count):
            key = chain_keys(ns.id, list(range(i * 16, (i + 1) * 16)), 16)[0]
            r = self.store.reserve(ns.tenant, ns, [key], None, now)
            data[r.offsets[0]:r.offsets[0] + ns.block_bytes] = content(key, ns.block_bytes)
            self.store.commit(ns.tenant, r.id, now)
            keys.append(key)
            self.peak = max(self.peak, self.slabs_held())
        return keys

    def check(self) -> None:
        """Every cached block reads its own bytes; the pools' and the store's checks."""
        for ns in self.store.namespaces.values():
            data = self.arena(ns.tenant)
            for key, b in ns.blocks.items():
                if b.offset is not None:
                    got = bytes(data[b.offset:b.offset + ns.block_bytes])
                    assert got == content(key, ns.block_bytes), f"{key.hex()} moved wrong"
        for tier in self.store.drams.values():
            tier.pool.check()
        self.store.check_invariants()


def slabs(ns: Namespace) -> int:
    return len(ns.dram.pool._owner)


def cached(ns: Namespace, keys: list[bytes]) -> int:
    return sum(1 for k in keys if (b := ns.blocks.get(k)) is not None and b.offset is not None)


def test_the_arenas_together_hold_at_most_the_capacity() -> None:
    arenas = Arenas()
    store = arenas.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas.put(a, 0, SLABS * 4)               # a alone: the whole capacity
    assert slabs(a) == SLABS
    arenas.put(a, 100, 8)                     # then its own blocks go
    assert slabs(a) == SLABS
    b_keys = arenas.put(b, 1000, SLABS * 4)   # b takes from a up to its share, then its own
    assert arenas.peak <= SLABS
    assert slabs(a) == slabs(b) == SLABS // 2
    assert cached(b, b_keys) == SLABS // 2 * 4
    assert store.dram_budget is not None and store.dram_budget.spare == 0
    arenas.check()


def test_a_third_tenant_below_its_share_takes_from_the_arena_furthest_over() -> None:
    arenas = Arenas()
    store = arenas.store
    a, b, c = (store.open_namespace(x) for x in (A, B, C))
    arenas.put(a, 0, 20)                      # 5 slabs
    arenas.put(b, 1000, 12)                   # 3 slabs: the budget is spent
    assert (slabs(a), slabs(b)) == (5, 3)
    arenas.put(c, 2000, 4)                    # shares 8/3: a is furthest over
    assert (slabs(a), slabs(b), slabs(c)) == (4, 3, 1)
    arenas.put(c, 2100, 4)                    # a still furthest over its share
    assert (slabs(a), slabs(b), slabs(c)) == (3, 3, 2)
    c_more = arenas.put(c, 2200, 4)           # c at its share: its own blocks go
    assert (slabs(a), slabs(b), slabs(c)) == (3, 3, 2)
    assert cached(c, c_more) == 4
    assert arenas.peak <= SLABS
    assert store.dram_budget is not None and store.dram_budget.taken == 2
    arenas.check()


def test_the_weights_set_the_arenas_shares() -> None:
    arenas = Arenas(tenant_weights={"a": 3.0})
    store = arenas.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas.put(a, 0, SLABS * 4)
    arenas.put(b, 1000, SLABS * 4)            # b's share: 2 of 8
    assert (slabs(a), slabs(b)) == (6, 2)
    arenas.put(a, 100, 8)                     # a at its share of 6: its own go
    assert (slabs(a), slabs(b)) == (6, 2)
    arenas.check()


def test_pinned_and_reserved_blocks_are_never_taken_by_another_arena() -> None:
    arenas = Arenas()
    store = arenas.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    keys = arenas.put(a, 0, SLABS * 4 - 4)    # 7 slabs and a half
    held = store.reserve("writer", a, [chain_keys(a.id, list(range(99_000, 99_016)),
                                                  16)[0]], None, 0.0)
    arenas.put(a, 500, 3)                     # the eighth slab full, one slot reserved
    for key in keys[:SLABS * 4 - 4]:
        store.acquire("reader", a, [key], 0.0)  # every committed block of 7 slabs pinned
    rejects = store.counters.capacity_rejects
    # one slab of unpinned blocks, but a reservation in it: b gets nothing of a's
    with pytest.raises(CapacityError):
        arenas.put(b, 1000, 1)
    assert store.counters.capacity_rejects == rejects + 1
    assert slabs(a) == SLABS and not b.blocks and cached(a, keys) == len(keys)
    store.abort("writer", held.id)
    b_keys = arenas.put(b, 1000, 4)           # the reservation gone: that slab is b's
    assert cached(a, keys) == len(keys) and cached(b, b_keys) == 4
    assert (slabs(a), slabs(b)) == (SLABS - 1, 1)
    arenas.check()


def test_a_slab_back_to_the_budget_is_told_with_its_place_in_its_arena() -> None:
    arenas = Arenas()
    store = arenas.store
    released: list[tuple[str, int, int]] = []
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas.put(a, 0, SLABS * 4)
    assert store.dram_budget is not None
    store.dram_budget.on_release = lambda *told: released.append(told)
    arenas.put(b, 1000, 4)
    assert len(released) == 1
    name, offset, length = released[0]
    assert name == "a" and length == SLAB and offset % SLAB == 0
    assert offset // SLAB not in a.dram.pool._owner
    assert b.dram.pool.budget is store.dram_budget
    arenas.check()


def test_an_emptied_slab_keeps_its_pages_until_another_arena_needs_the_memory() -> None:
    """Giving a slab's pages back took the kernel 45-60 ms a 64 MiB slab on the loop,
    and a busy arena's slabs empty and fill again all the time: the pages of an emptied
    slab stay for its arena (taken again first) and go only once another arena's growth
    would take the arenas' memory past the budget."""
    arenas = Arenas()
    store = arenas.store
    budget = store.dram_budget
    assert budget is not None
    released: list[tuple[str, int, int]] = []
    budget.on_release = lambda *told: released.append(told)
    a, b = store.open_namespace(A), store.open_namespace(B)
    keys = arenas.put(a, 0, SLABS * 4)  # a: the whole capacity
    pool = a.dram.pool

    def empty_slabs_of_a(count: int) -> set[int]:
        """Drop the blocks of ``count`` of a's slabs: those slabs' indexes."""
        by_slab: dict[int, list[bytes]] = {}
        for key in keys:
            block = a.blocks.get(key)
            if block is not None and block.offset is not None:
                by_slab.setdefault(block.offset // SLAB, []).append(key)
        gone = set(sorted(by_slab)[:count])
        for index in gone:
            store.drop_subtree(a, [a.blocks[k] for k in by_slab[index]], [])
        return gone

    gone = empty_slabs_of_a(2)
    assert pool._resident == gone and not released
    arenas.put(a, 1000, 4)  # a fills one of them again: its pages, nothing given back
    assert len(pool._resident) == 1 and pool._resident < gone and not released
    arenas.put(b, 2000, 4)  # b's slab would take the memory past the budget: a's kept go
    assert len(released) == 1 and not pool._resident
    name, offset, length = released[0]
    assert name == "a" and offset // SLAB in gone and length == SLAB
    assert offset // SLAB in pool._empty and offset // SLAB not in pool._owner
    assert budget.figures()["kept"] == 0
    arenas.check()


def test_a_shared_arena_has_no_budget() -> None:
    store = BlockStore(SLABS * SLAB, SLAB)
    a, b = store.open_namespace(A), store.open_namespace(B)
    assert store.dram_budget is None and a.dram is b.dram and a.dram.pool.budget is None


def one_slab_budget() -> tuple[BlockStore, ArenaBudget, list[float], Namespace, Namespace,
                              Arenas]:
    """A store of per-tenant arenas under a budget of one slab, on a clock the test moves
    (``now[0]``), tenants A's and B's namespaces open, and the arenas holding bytes."""
    store = BlockStore(SLAB, SLAB, per_tenant=True)
    budget = store.dram_budget
    assert budget is not None
    now = [0.0]
    budget.clock = lambda: now[0]
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas = Arenas.__new__(Arenas)
    arenas.store, arenas.bytes, arenas.peak = store, {}, 0
    store.move_bytes = arenas._move
    return store, budget, now, a, b, arenas


def test_with_more_arenas_than_slabs_one_holding_none_takes_only_an_idle_ones() -> None:
    """A tenant holding none took a slab from another at each request, so with more
    tenants writing than slabs the slabs bounced between arenas every request: it takes
    only the slab of an arena that wrote nothing for ``min_hold``, else is refused."""
    store, budget, now, a, b, arenas = one_slab_budget()
    a_keys = arenas.put(a, 0, 4)
    now[0] += budget.min_hold / 2  # a wrote lately: b's share (half a slab) waits
    with pytest.raises(CapacityError, match="raise dram.capacity or lower dram.slab_size"):
        arenas.put(b, 1000, 1)
    assert (slabs(a), slabs(b)) == (1, 0) and cached(a, a_keys) == 4 and not b.blocks
    now[0] += budget.min_hold  # a idle since: its slab is b's
    b_keys = arenas.put(b, 1000, 1)
    assert (slabs(a), slabs(b)) == (0, 1) and cached(b, b_keys) == 1
    with pytest.raises(CapacityError):  # and not a's again at once
        arenas.put(a, 100, 1)
    assert budget.taken == 1 and budget.held_back == 2
    arenas.check()


def test_the_slab_of_per_tenant_arenas_cuts_the_capacity_into_sixteen_at_least() -> None:
    assert budget_slab_bytes(64 << 20, 64 << 20) == 4 << 20   # default slab, small capacity
    assert budget_slab_bytes(64 << 20, 1 << 30) == 64 << 20   # 16 slabs already
    assert budget_slab_bytes(1 << 20, 64 << 20) == 1 << 20    # smaller asked: kept
    assert budget_slab_bytes(64 << 20, 512 << 10) == 64 << 10  # never under 64 KiB


def test_a_request_the_spare_slabs_cover_in_part_takes_the_rest_from_another_arena() -> None:
    arenas = Arenas()
    store = arenas.store
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas.put(a, 0, (SLABS - 1) * 4)        # one slab spare
    chain = chain_keys(b.id, list(range(16 * 8)), 16)  # 8 blocks: two slabs at once
    r = store.reserve("b", b, chain, None, 0.0)
    assert not isinstance(r, Plan) and len(r.offsets) == 8
    for key, offset in zip(chain, r.offsets):
        arenas.arena("b")[offset:offset + b.block_bytes] = content(key, b.block_bytes)
    store.commit("b", r.id, 0.0)
    assert (slabs(a), slabs(b)) == (SLABS - 2, 2)
    arenas.check()


class Backer:
    """The daemon's side of backing slabs, by hand: what was asked, answered later."""

    def __init__(self, store: BlockStore) -> None:
        self.budget = store.dram_budget
        assert self.budget is not None
        self.budget.backer = self.ask
        self.asked: list[tuple[str, int]] = []

    def ask(self, name: str, index: int, offset: int, length: int) -> None:
        assert offset == index * length
        self.asked.append((name, index))

    def answer(self, ok: bool) -> None:
        assert self.budget is not None
        asked, self.asked = self.asked, []
        for name, index in asked:
            self.budget.backed(name, index, ok)


def reserve_one(store: BlockStore, ns: Namespace, n: int) -> object:
    key = chain_keys(ns.id, list(range(n * 16, (n + 1) * 16)), 16)[0]
    return store.reserve(ns.tenant, ns, [key], None, 0.0)


def test_no_slot_of_a_slab_is_handed_out_before_its_memory_is_there() -> None:
    """A page of a sparse arena first touched with its file system full raised SIGBUS
    in the process touching it: a slab's memory is asked for (off the loop) before any
    slot of it is handed out, the request answered with a turn meanwhile."""
    store = BlockStore(SLABS * SLAB, SLAB, per_tenant=True)
    backer = Backer(store)
    a = store.open_namespace(A)
    assert backer.asked == [("a", 0)]  # its first slab, ahead of its first request
    r = reserve_one(store, a, 0)
    assert isinstance(r, Plan) and r.turn and not a.dram.pool._owner
    r.let_go()
    backer.answer(True)
    r = reserve_one(store, a, 0)
    assert not isinstance(r, Plan) and r.offsets[0] // SLAB == 0
    assert backer.asked == [("a", 1)]  # the next slab, ahead of need
    a.dram.pool.check()


def test_an_arena_whose_memory_ran_out_makes_room_among_its_own_then_refuses() -> None:
    store = BlockStore(SLABS * SLAB, SLAB, per_tenant=True)
    backer = Backer(store)
    a = store.open_namespace(A)
    backer.answer(True)
    b = store.open_namespace(B)
    backer.answer(False)  # b's first slab finds no memory (the file system is full)
    for n in range(4):  # a's first slab, full; its next slab finds none either
        r = reserve_one(store, a, n)
        assert not isinstance(r, Plan)
        store.commit("a", r.id, 0.0)
    backer.answer(False)
    r = reserve_one(store, a, 10)  # its own coldest block makes the room
    assert not isinstance(r, Plan) and len(a.dram.pool._owner) == 1
    assert cached(a, [chain_keys(a.id, list(range(n * 16, n * 16 + 16)), 16)[0]
                      for n in range(4)]) == 3
    store.abort("a", r.id)
    with pytest.raises(CapacityError, match="dram.directory is full"):
        reserve_one(store, b, 20)  # nothing of its own to make room among
    assert not b.blocks and not b.dram.pool._owner and not backer.asked
    assert store.dram_budget is not None and store.dram_budget.backing_failed == 2
    for tier in store.drams.values():
        tier.pool.check()
    store.check_invariants()


def test_a_request_takes_one_slab_of_another_arena_a_turn() -> None:
    """Each slab another arena gives up holds the loop (its blocks evicted and moved,
    its memory given back): a request short of several takes one a turn, the slab set
    aside for it meanwhile, never several in one go."""
    arenas = Arenas()
    store = arenas.store
    budget = store.dram_budget
    assert budget is not None
    released: list[tuple[str, int, int]] = []
    budget.on_release = lambda *told: released.append(told)
    a, b = store.open_namespace(A), store.open_namespace(B)
    arenas.put(a, 0, SLABS * 4)
    chain = chain_keys(b.id, list(range(16 * 12)), 16)  # 12 blocks: three slabs
    taken = []
    while isinstance(r := store.reserve("b", b, chain, None, 0.0), Plan):
        assert r.turn and budget.taken == len(taken) + 1, r  # one slab a call
        taken.append(budget.taken)
        assert b.dram.pool.earmarked(b.cls) == len(taken)  # set aside for it
        a.dram.pool.check()
        r.let_go()
    assert taken == [1, 2] and budget.taken == 3
    store.abort("b", r.id)
    assert (slabs(a), slabs(b)) == (SLABS - 3, 0)
    arenas.check()


def test_an_arena_whose_blocks_are_read_is_not_idle() -> None:
    """With more arenas than slabs, an arena holding none takes the last slab only of
    an idle one; a tenant that only read its blocks (hits, no writes) counted as idle,
    and a writer evicted its whole cache while it read it: reads count as use."""
    store, budget, now, a, b, arenas = one_slab_budget()
    a_keys = arenas.put(a, 0, 4)
    for _ in range(3):  # a reads its blocks, writing nothing; b asks meanwhile
        now[0] += budget.min_hold * 0.6
        pin = store.acquire("a", a, a_keys[:1], now[0])
        assert not isinstance(pin, Plan)
        store.release("a", pin.id)
        with pytest.raises(CapacityError, match="raise dram.capacity"):
            arenas.put(b, 1000, 1, now[0])
    assert (slabs(a), slabs(b)) == (1, 0) and cached(a, a_keys) == 4
    now[0] += budget.min_hold  # a neither wrote nor read since: its slab is b's
    arenas.put(b, 1000, 1, now[0])
    assert (slabs(a), slabs(b)) == (0, 1)
    arenas.check()


def reserve_backed(store: BlockStore, backer: Backer, ns: Namespace, first: int,
                   count: int) -> object:
    """A reserve of ``count`` one-block chains, made again (each slab's memory answered
    as there) until it is not a plan."""
    keys = [chain_keys(ns.id, list(range(n * 16, (n + 1) * 16)), 16)[0]
            for n in range(first, first + count)]
    while isinstance(r := store.reserve(ns.tenant, ns, keys, None, 0.0), Plan):
        r.let_go()
        backer.answer(True)
    return r


def test_an_arena_waiting_for_memory_keeps_its_own_kept_slab() -> None:
    """Memory is made for a slab an arena waits for by giving back another arena's kept
    slab; where no other arena kept one (another's slab being backed ahead meanwhile),
    the arena's own kept slab was given back to allocate another of its own in its
    place: a slab's memory punched out and allocated again for nothing (45-60 and 16 ms
    a 64 MiB slab on the arenas' thread), the request still waiting."""
    store = BlockStore(SLABS * SLAB, SLAB, per_tenant=True)
    backer = Backer(store)
    budget = store.dram_budget
    assert budget is not None
    released: list[tuple[str, int]] = []
    budget.on_release = lambda name, offset, length: released.append((name, offset // SLAB))
    a = store.open_namespace(A)
    r = reserve_backed(store, backer, a, 0, 6 * 4)  # six slabs of a's, full
    assert not isinstance(r, Plan)
    backer.answer(True)  # its next slab, ahead
    kept = set(a.dram.pool._resident)
    assert len(kept) == 1 and budget.memory() == SLABS - 1
    b = store.open_namespace(B)  # b's first slab is backed ahead: the memory is all asked
    assert backer.asked == [("b", 0)] and budget.memory() == SLABS
    r = store.reserve("a", a, [chain_keys(a.id, list(range(n * 16, (n + 1) * 16)), 16)[0]
                               for n in range(100, 108)], None, 0.0)  # two slabs at once
    assert isinstance(r, Plan) and r.turn
    r.let_go()
    assert a.dram.pool._resident == kept and not released  # a's kept slab stays
    assert backer.asked == [("b", 0)]
    r = reserve_backed(store, backer, a, 100, 8)  # b's slab, backed, is given for a's
    assert not isinstance(r, Plan) and len(a.dram.pool._owner) == 8
    assert released == [("b", 0)]
    for tier in store.drams.values():
        tier.pool.check()
