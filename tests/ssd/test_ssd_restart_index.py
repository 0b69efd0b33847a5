"""A warm restart of an index big enough to take the restore's bulk paths (more entries
than one scan chunk, a namespace past the size at which its key map splits: both made
small here, so that the index need not be) gives back
the index as written: every block with its key, parent, SSD slot and checksum, in the
SSD tier only, with its children, over branching chains in several namespaces; and in
the same orders (key map, children, eviction) as the record-by-record restore."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import make_identity
from ssd_helpers import restoring_mover

import pytest
from kvstore import block_map, ssd_copies
from kvstore.store import BlockStore
from kvstore.tiering import SsdMover
from kvstore.tiers.ssd import BlockRecord, SSDStore
from kvstore.tiers import ssd_directory, ssd_rows
from kvstore.tiers.ssd_rows import Rows, _any_overlap, _keys_of

MiB = 1 << 20
SLAB = 4 * MiB
SLOT = 4096
SPLIT_AT = 2048  # the key map's split, and the chunks of the scan and of the keys made
# one namespace past the key map's split, two smaller: many chunks
SIZES = (SPLIT_AT + 700, 1_600, 1_600)
CAPACITY = -(-sum(SIZES) * SLOT // SLAB) * SLAB
IDENTS = [make_identity(model=f"restart{i}", num_layers=1, num_kv_heads=1, head_dim=8)
          for i in range(len(SIZES))]


def _forest(rng: random.Random, ns: bytes, count: int, slots: list[int]) -> list[BlockRecord]:
    """``count`` records of chains: each chain starts at a root or branches off a block
    already there (a third of them); some keys end in zero bytes."""
    records: list[BlockRecord] = []
    while len(records) < count:
        parent = rng.choice(records).key if records and rng.random() < 0.33 else None
        for _ in range(min(rng.randint(1, 100), count - len(records))):
            key = rng.randbytes(16)
            if rng.random() < 0.05:
                key = key[:12] + bytes(4)
            records.append(BlockRecord(ns, key, parent, slots.pop() * SLOT, 512,
                                       checksum=rng.getrandbits(64), size_class=SLOT))
            parent = key
    return records


def _write(path: Path, records: list[BlockRecord]) -> None:
    engine = SSDStore(path, CAPACITY, slab_bytes=SLAB, sync="none", direct_io=False,
                      preallocate=False)
    try:
        for ident in IDENTS:
            engine.put_namespace(ident.namespace_id, msgspec.msgpack.encode(ident))
        index = engine._parts()[1]
        index.commit(records)
    finally:
        engine.close()


def _mover(path: Path) -> tuple[BlockStore, SsdMover]:
    return restoring_mover(path, CAPACITY, SLAB)


def _orders(store: BlockStore) -> dict[str, Any]:
    """What the restore's order decides: the key maps' order, each block's children in
    theirs, the SSD eviction order."""
    assert store.ssd is not None
    return {
        "maps": {ns.id: list(ns.blocks) for ns in store.namespaces.values()},
        "kids": {(ns.id, key): [k.key for k in b.child_list()]
                 for ns in store.namespaces.values() for key, b in ns.blocks.items()},
        "eviction": {size: [(b.ns.id, b.key) for b in policy.evictable()]
                     for size, policy in store.ssd.policies.items()}}


def test_a_restart_gives_back_the_index_as_written(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_map, "SPLIT_AT", SPLIT_AT)
    monkeypatch.setattr(ssd_copies, "SPLIT_AT", SPLIT_AT)
    monkeypatch.setattr(ssd_directory, "_ROWS_CHUNK", SPLIT_AT)
    monkeypatch.setattr(ssd_rows, "_KEYS_CHUNK", SPLIT_AT // 3)
    rng = random.Random(20)
    slots = list(range(sum(SIZES)))
    rng.shuffle(slots)
    records = [r for ident, count in zip(IDENTS, SIZES)
               for r in _forest(rng, ident.namespace_id, count, slots)]
    rng.shuffle(records)  # committed in no particular order
    _write(tmp_path, records)

    store, mover = _mover(tmp_path)
    try:
        assert mover.restore() == len(records)
        store.check_invariants()
        assert not mover._pending_removals
        children: dict[tuple[bytes, bytes], set[bytes]] = {}
        for r in records:
            if r.parent is not None:
                children.setdefault((r.namespace, r.parent), set()).add(r.key)
        for r in records:
            block = store.namespaces[r.namespace].blocks[r.key]
            assert block.key == r.key
            assert (block.parent.key if block.parent is not None else None) == r.parent
            assert (block.ssd_offset, block.checksum, block.offset) == (r.offset, r.checksum,
                                                                        None)
            assert {k.key for k in block.child_list()} == children.get((r.namespace, r.key),
                                                                       set())
        assert sorted(len(ns.blocks) for ns in store.namespaces.values()) == sorted(SIZES)
        assert len(store.namespaces[IDENTS[0].namespace_id].blocks.shards) > 1  # split
        columns = _orders(store)
        assert sum(map(len, columns["eviction"].values())) == len(records)
    finally:
        mover.close()

    # the same index restored record by record (``load``, ``restore_many``)
    store, mover = _mover(tmp_path)
    try:
        namespaces = {i.namespace_id: store.open_namespace(i) for i in IDENTS}
        found: dict[bytes, list[BlockRecord]] = {}
        for record in mover.engine.load():
            found.setdefault(record.namespace, []).append(record)
        for ns_id, group in found.items():
            assert all(store.ssd_copies.restore_many(namespaces[ns_id], group))
        assert _orders(store) == columns
    finally:
        mover.close()


@settings(deadline=None)  # (a loaded machine's pause is no failure)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([0, 8, 16, 32])),
                min_size=2, max_size=12), st.sampled_from([8, 16, 32]))
def test_overlap_by_one_extent_is_the_running_maximums(
        slots: list[tuple[int, int]], length: int) -> None:
    rows = Rows()
    rows.offset = np.array([o for o, _ in slots], dtype=np.int64)
    rows.size_class = np.array([s for _, s in slots], dtype=np.int64)
    rows.length = np.full(len(slots), length, dtype=np.int64)
    order = np.argsort(rows.offset, kind="stable")
    starts = rows.offset[order]
    furthest = np.maximum.accumulate(
        starts + np.maximum(rows.length, rows.size_class)[order])
    assert _any_overlap(rows) == bool(np.any(starts[1:] < furthest[:-1]))


def test_keys_keep_their_zero_bytes() -> None:
    keys = [bytes(16), b"\x01" + bytes(15), bytes(15) + b"\x01", b"k" * 16]
    words = np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, 2)
    assert _keys_of(words) == keys
    assert _keys_of(words, np.array([3, 0, 2])) == [keys[3], keys[0], keys[2]]
