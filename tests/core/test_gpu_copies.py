"""The GPU tier's bookkeeping in the store: copies follow DRAM copies, pinned ones stay."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.store import Block, BlockStore, Namespace

IDENT = make_identity()
SLOT = IDENT.block_bytes


def store_of(dram_slots: int, gpu_slots: int) -> BlockStore:
    return BlockStore(dram_slots * SLOT, dram_slots * SLOT, gpu_capacity=gpu_slots * SLOT,
                      gpu_slab_bytes=gpu_slots * SLOT)


def put(store: BlockStore, ns: Namespace, i: int, now: float = 0.0) -> Block:
    key = chain_keys(ns.id, list(range(i * 16, (i + 1) * 16)), 16)[0]
    r = store.reserve("w", ns, [key], None, now)
    store.commit("w", r.id, now)
    return ns.blocks[key]


def copy(store: BlockStore, blocks: list[Block], ok: bool = True) -> list[tuple[Block, int]]:
    plan = store.gpu_begin(blocks)
    for b, _ in plan:
        assert b.refs >= 1  # the DRAM copy stays put while it is read
    store.gpu_end(plan, ok)
    return plan


def test_copies_go_cold_first_and_never_while_pinned() -> None:
    store = store_of(16, 2)
    ns = store.open_namespace(IDENT)
    a, b, c = (put(store, ns, i) for i in range(3))
    assert len(copy(store, [a, b])) == 2 and a.gpu_offset is not None
    pin = store.acquire("r", ns, [a.key], 1.0)   # a is pinned, and now warmer than b
    assert copy(store, [c]) == [(c, c.gpu_offset)]
    assert b.gpu_offset is None and a.gpu_offset is not None
    d = put(store, ns, 3)
    assert copy(store, [d]) == [(d, d.gpu_offset)]   # c went: a is pinned
    assert c.gpu_offset is None and a.gpu_offset is not None
    store.release("r", pin.id)
    store.check_invariants()
    assert store.gpu is not None and store.gpu.stats()["evictions"] == 2


def test_a_failed_copy_frees_its_slot_and_a_dram_eviction_drops_the_copy() -> None:
    store = store_of(2, 4)
    ns = store.open_namespace(IDENT)
    a = put(store, ns, 0)
    copy(store, [a], ok=False)
    assert a.gpu_offset is None and a.refs == 0
    copy(store, [a])
    assert a.gpu_offset is not None
    put(store, ns, 1)
    put(store, ns, 2)                               # DRAM holds two: a is evicted
    assert a.offset is None and a.gpu_offset is None
    store.check_invariants()
    assert store.gpu is not None and store.gpu.stats()["blocks"] == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "copy", "pin", "unpin", "fail"]),
                          st.integers(0, 9)), max_size=60))
def test_gpu_accounting_holds_under_any_mix(ops: list[tuple[str, int]]) -> None:
    store = store_of(6, 3)
    ns = store.open_namespace(IDENT)
    pins: list[int] = []
    for step, (op, i) in enumerate(ops):
        now = float(step)
        key = chain_keys(ns.id, list(range(i * 16, (i + 1) * 16)), 16)[0]
        block = ns.blocks.get(key)
        if op == "put" and block is None:
            try:
                put(store, ns, i, now)
            except Exception:  # noqa: BLE001 - DRAM full of pins: refused, no trace
                pass
        elif op in ("copy", "fail") and block is not None and block.offset is not None:
            copy(store, [block], ok=op == "copy")
        elif op == "pin" and block is not None and block.offset is not None:
            pins.append(store.acquire("r", ns, [key], now).id)
        elif op == "unpin" and pins:
            store.release("r", pins.pop())
        store.check_invariants()
        for b in ns.blocks.values():
            if b.refs:
                assert b.offset is not None
