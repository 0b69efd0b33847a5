"""A warm restart in columns (``ssd_rows``, ``SSDStore.load_rows``, ``SsdMover.restore``)
keeps, drops and restores exactly what the record-by-record path does: the same blocks
with the same parents, slots and checksums, in the same eviction order, with branches,
missing parents, cycles, records that do not fit, values that do not decode or sit
under another key, values of an older shape, overlapping slots and namespaces that are
gone."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import make_identity
from ssd_helpers import restoring_mover

from kvstore.ssd_copies import restore_blocks
from kvstore.store import BlockStore
from kvstore.tiering import SsdMover
from kvstore.tiers.ssd import BlockRecord, SSDStore
from kvstore.tiers import ssd_layout
from kvstore.tiers.ssd_layout import encode_record
from kvstore.tiers.ssd_rows import decode_values

MiB = 1 << 20
CAPACITY = 16 * MiB
SLAB = MiB
IDENTS = [make_identity(tenant="acme", model=f"m{i}") for i in range(3)]

_uints = st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                          2**62 - 1])
_ids = st.binary(min_size=16, max_size=16)


@given(st.lists(st.tuples(_ids, _ids, st.none() | _ids, _uints, _uints,
                          _uints | st.sampled_from([2**63, 2**64 - 1]),
                          st.floats(allow_nan=False), _uints), min_size=1, max_size=40))
def test_values_decode_in_arrays_as_msgspec_decodes_them(fields: list[Any]) -> None:
    records = [BlockRecord(*f) for f in fields]
    columns = decode_values([r.index_key for r in records], list(map(encode_record, records)))
    assert columns is not None
    spaces, keys, parents, roots, offset, length, checksum, size = columns
    assert spaces.tobytes() == b"".join(r.namespace for r in records)
    assert keys.tobytes() == b"".join(r.key for r in records)
    assert parents.tobytes() == b"".join(r.parent or bytes(16) for r in records)
    assert roots.tolist() == [r.parent is None for r in records]
    assert offset.tolist() == [r.offset for r in records]
    assert length.tolist() == [r.length for r in records]
    assert checksum.tolist() == [r.checksum for r in records]
    assert size.tolist() == [r.size_class for r in records]


def test_values_of_another_shape_or_key_are_left_to_msgspec() -> None:
    record = BlockRecord(bytes(16), b"k" * 16, None, 4096, 4096, checksum=7, size_class=4096)
    value = encode_record(record)
    assert decode_values([record.index_key], [value]) is not None
    older = msgspec.msgpack.encode([record.namespace, record.key, None, 4096, 4096])
    assert msgspec.msgpack.decode(older, type=BlockRecord).length == 4096  # it decodes
    assert decode_values([record.index_key], [older]) is None
    assert decode_values([bytes(16) + b"x" * 16], [value]) is None  # under another key
    assert decode_values([record.index_key], [value + b"\x00"]) is None  # trailing byte
    signed = msgspec.msgpack.encode(
        [record.namespace, record.key, None, -1, 4096, 0, 0.0, 4096])
    assert decode_values([record.index_key], [signed]) is None


def _namespace_sizes() -> dict[bytes, tuple[int, int]]:
    """Each identity's block bytes and SSD slot bytes under ``_config``."""
    store = BlockStore(4 * MiB, MiB, ssd_capacity=CAPACITY, ssd_slab_bytes=SLAB)
    sizes = {}
    for ident in IDENTS:
        ns = store.open_namespace(ident)
        assert ns.ssd_cls is not None
        sizes[ns.id] = (ns.block_bytes, ns.ssd_cls.slot_bytes)
    return sizes


SIZES = _namespace_sizes()


def _index(seed: int, extras: frozenset[str]) -> tuple[list[BlockRecord], dict[bytes, bytes]]:
    """A random index: forests with branches in three namespaces (or "one"), and the
    faults ``extras`` names; raw entries (index key -> value) besides."""
    rng = random.Random(seed)
    spaces = [i.namespace_id for i in IDENTS]
    records: list[BlockRecord] = []
    slot = 0
    for _ in range(rng.randint(1, 60)):
        ns = spaces[0] if "one" in extras else rng.choice(spaces)
        block, size = SIZES[ns]
        mine = [r.key for r in records if r.namespace == ns]
        parent = rng.choice(mine) if mine and rng.random() < 0.8 else None
        if "missing" in extras and rng.random() < 0.1:
            parent = rng.randbytes(16)
        records.append(BlockRecord(ns, rng.randbytes(16), parent, slot * size,
                                   block if rng.random() > 0.05 else block // 2,
                                   checksum=rng.getrandbits(64), last_access=rng.random(),
                                   size_class=size))
        slot += 1
    if "cycle" in extras:
        a, b = rng.randbytes(16), rng.randbytes(16)
        ns = spaces[0]
        block, size = SIZES[ns]
        records += [BlockRecord(ns, a, b, slot * size, block, size_class=size),
                    BlockRecord(ns, b, a, (slot + 1) * size, block, size_class=size)]
        slot += 2
    if "unfit" in extras:
        ns = spaces[1]
        records += [BlockRecord(ns, rng.randbytes(16), None, SLAB - 4096, 8192),  # crosses
                    BlockRecord(ns, rng.randbytes(16), None, CAPACITY, 4096),  # outside
                    BlockRecord(ns, rng.randbytes(16), None, 0, 8192, size_class=4096)]
    if "overlap" in extras and records:
        first = records[0]
        records.append(msgspec.structs.replace(first, key=rng.randbytes(16), parent=None,
                                               last_access=2.0))
    raw: dict[bytes, bytes] = {}
    if "garbage" in extras:
        raw[spaces[0] + rng.randbytes(16)] = b"\xc1 not msgpack"
        if records:
            raw[spaces[0] + rng.randbytes(16)] = encode_record(records[-1])  # another key
    if "older" in extras:
        ns = spaces[2]
        key = rng.randbytes(16)
        block, size = SIZES[ns]
        raw[ns + key] = msgspec.msgpack.encode([ns, key, None, (slot + 1) * size, block])
    return records, raw


def _write(path: Path, records: list[BlockRecord], raw: dict[bytes, bytes],
           gone: set[bytes]) -> None:
    engine = SSDStore(path, CAPACITY, slab_bytes=SLAB, sync="none", direct_io=False,
                      preallocate=False)
    try:
        for ident in IDENTS:
            if ident.namespace_id not in gone:
                engine.put_namespace(ident.namespace_id, msgspec.msgpack.encode(ident))
        index = engine._parts()[1]
        index.commit(records)
        with index._env.begin(write=True) as txn:
            for key, value in raw.items():
                txn.put(key, value, db=index._blocks)
    finally:
        engine.close()


def _mover(path: Path) -> tuple[BlockStore, SsdMover]:
    return restoring_mover(path, CAPACITY, SLAB)


def _restore_by_records(mover: SsdMover) -> int:
    """The warm restart as it was record by record (``SSDStore.load`` and
    ``restore_many`` per namespace): the reference the columns are held to."""
    store = mover.store
    namespaces = {}
    for ns_id, blob in mover.engine.namespaces().items():
        identity = msgspec.msgpack.decode(blob, type=type(IDENTS[0]))
        namespaces[ns_id] = store.open_namespace(identity)
    found: dict[bytes, list[BlockRecord]] = {}
    for record in mover.engine.load():
        ns = namespaces.get(record.namespace)
        if ns is not None and ns.ssd_cls is not None and (
                record.length == ns.block_bytes and record.size_class == ns.ssd_cls.slot_bytes):
            found.setdefault(ns.id, []).append(record)
        else:
            mover._pending_removals.append((record.namespace, record.key))
    restored = 0
    for ns_id, group in found.items():
        ok = store.ssd_copies.restore_many(namespaces[ns_id], group)
        restored += sum(ok)
        mover._pending_removals.extend((ns_id, r.key) for r, good in zip(group, ok)
                                       if not good)
    for ns in list(namespaces.values()):
        store.close_namespace(ns)
    return restored


def _state(store: BlockStore, mover: SsdMover) -> dict[str, Any]:
    assert store.ssd is not None
    blocks = {
        (ns.id, key): (b.parent.key if b.parent is not None else None, b.ssd_offset,
                       b.checksum, sorted(k.key for k in b.child_list()))
        for ns in store.namespaces.values() for key, b in ns.blocks.items()}
    orders = {size: [(b.ns.id, b.key) for b in policy.evictable()]
              for size, policy in store.ssd.policies.items()}
    return {"blocks": blocks, "orders": orders, "removals": sorted(mover._pending_removals),
            "namespaces": sorted(store.namespaces), "stats": {
                k: v for k, v in mover.engine.stats().items() if not k.endswith("seconds")}}


EXTRAS = ["one", "missing", "cycle", "unfit", "overlap", "garbage", "older"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), extras=st.frozensets(st.sampled_from(EXTRAS)),
       gone=st.booleans())
def test_a_restore_in_columns_is_the_restore_record_by_record(
        tmp_path_factory: Any, seed: int, extras: frozenset[str], gone: bool) -> None:
    records, raw = _index(seed, extras)
    missing = {IDENTS[2].namespace_id} if gone else set()
    states = []
    for way in ("records", "columns"):
        path = tmp_path_factory.mktemp(way)
        _write(path, records, raw, missing)
        store, mover = _mover(path)
        try:
            if way == "columns":
                restored = mover.restore()
            else:
                restored = _restore_by_records(mover)
            store.check_invariants()
            states.append((restored, _state(store, mover)))
        finally:
            mover.close()
    assert states[0] == states[1]


def test_load_rows_keeps_the_survivors_of_load_in_their_order(tmp_path: Path) -> None:
    records, raw = _index(7, frozenset({"missing", "cycle", "unfit", "garbage", "older"}))
    plans = []
    for way in ("load", "rows"):
        _write(tmp_path / way, records, raw, set())
        engine = SSDStore(tmp_path / way, CAPACITY, slab_bytes=SLAB, sync="none",
                          direct_io=False, preallocate=False)
        try:
            if way == "load":
                kept = [(r.namespace, r.key, r.parent, r.offset, r.checksum)
                        for r in engine.load()]
            else:
                plan = engine.load_rows()
                rows = plan.rows
                key = dict(zip(plan.order.tolist(), plan.keys))  # by row
                kept = [(rows.spaces[s], key[i], key[p] if p >= 0 else None, o, c)
                        for i, s, p, o, c in zip(
                            plan.order.tolist(), rows.space[plan.order].tolist(),
                            plan.parent[plan.order].tolist(), rows.offset[plan.order].tolist(),
                            rows.checksum[plan.order].tolist())]
            plans.append((kept, engine.stats()["records"], engine.stats()["dropped_invalid"],
                          engine.stats()["dropped_orphans"]))
        finally:
            engine.close()
    assert plans[0] == plans[1]
    assert plans[0][2] and plans[0][3]  # some were dropped, for either reason


def test_restoring_columns_as_restore_many_does() -> None:
    store = BlockStore(4 * MiB, MiB, ssd_capacity=CAPACITY, ssd_slab_bytes=SLAB)
    ns = store.open_namespace(IDENTS[0])
    assert ns.ssd_cls is not None
    size = ns.ssd_cls.slot_bytes
    keys = [os.urandom(16) for _ in range(4)]
    # a root, its child, an orphan whose slot a later one takes, that later one
    ok = restore_blocks(store, ns, keys, [None, keys[0], os.urandom(16), keys[1]],
                        [0, size, 2 * size, 2 * size], [1, 2, 3, 4])
    assert ok == [True, True, False, True]
    assert ns.blocks[keys[3]].ssd_offset == 2 * size
    assert ns.blocks[keys[3]].parent is ns.blocks[keys[1]]
    assert keys[2] not in ns.blocks


@given(parents=st.lists(st.integers(-3, 12), min_size=2, max_size=12))
def test_one_namespaces_closure_in_arrays_is_the_walk_in_its_order(parents: list[int]) -> None:
    # one namespace takes the arrays' other sort (one key, no namespace words compared);
    # a negative parent is a root, one past the records a missing parent
    key = [bytes([i]) * 16 for i in range(13)]
    records = [BlockRecord(b"n" * 16, key[i], None if p < 0 else key[p], i * 16, 16)
               for i, p in enumerate(parents)]
    assert ssd_layout._closed_in_arrays(records) == ssd_layout._closed_by_walk(records)


class _Found(msgspec.Struct):
    key: bytes
    parent: bytes | None
    offset: int
    checksum: int


@given(st.lists(st.tuples(st.integers(-2, 20), st.integers(0, 6)), min_size=1, max_size=20),
       st.booleans())
def test_restoring_columns_by_position_is_restore_many(
        entries: list[tuple[int, int]], before: bool) -> None:
    # parents by position (-1 a root, -2 or a later one: not there), slots that clash
    keys = [bytes([i]) * 16 for i in range(len(entries))]
    at = [p if p < i else -2 for i, (p, _) in enumerate(entries)]
    stores = []
    for way in ("columns", "records"):
        store = BlockStore(4 * MiB, MiB, ssd_capacity=CAPACITY, ssd_slab_bytes=SLAB)
        ns = store.open_namespace(IDENTS[0])
        assert ns.ssd_cls is not None
        size = ns.ssd_cls.slot_bytes
        offsets = [s * size for _, s in entries]
        if before:  # a block there already (not fresh: looked up by key)
            store.ssd_copies.restore_many(ns, [_Found(b"\xff" * 16, None, 9 * size, 0)])
        if way == "columns":
            back = [0 if a == -1 else -1 if a < 0 else i - a for i, a in enumerate(at)]
            ok = store.ssd_copies.restore_columns(ns, keys, back, offsets,
                                                  list(range(len(keys))))
        else:
            found = [_Found(k, None if a == -1 else keys[a] if a >= 0 else b"\xee" * 16,
                            o, i) for i, (k, a, o) in enumerate(zip(keys, at, offsets))]
            ok = store.ssd_copies.restore_many(ns, found)
        store.check_invariants()
        stores.append((ok, {k: (b.parent.key if b.parent else None, b.ssd_offset, b.checksum,
                                sorted(c.key for c in b.child_list()))
                            for k, b in ns.blocks.items()}))
    assert stores[0] == stores[1]
