"""Corrupt, truncated and stale bytes are misses; warm restart keeps a prefix-closed index."""

from __future__ import annotations

import os
from pathlib import Path

from ssd_helpers import KiB, MiB, StoreFactory, chain, read_ok, run, write
from kvstore.tiers.ssd import BlockRecord
from kvstore.tiers.ssd_layout import encode_record
from kvstore.tiers.ssd_index import SSDIndex


def data_file(tmp_path: Path) -> Path:
    return tmp_path / "ssd" / "blocks.dat"


def test_flipped_byte_is_a_miss_and_drops_the_record(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    store = open_store()
    namespace = os.urandom(16)
    first, second = write(store, chain(namespace, 2, 256 * KiB, 0))
    with open(data_file(tmp_path), "r+b") as f:
        f.seek(second.offset + 12345)
        byte = f.read(1)[0]
        f.seek(second.offset + 12345)
        f.write(bytes([byte ^ 0x40]))

    assert read_ok(store, first)
    assert not read_ok(store, second)
    assert store.lookup((namespace, second.key)) is None
    assert store.lookup((namespace, first.key)) is not None
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["records"] == 1


def test_truncated_data_file_is_a_miss(open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store()
    namespace = os.urandom(16)
    records = write(store, chain(namespace, 4, 2 * MiB, 0))
    os.truncate(data_file(tmp_path), records[2].offset + MiB)

    assert [read_ok(store, r) for r in records] == [True, True, False, False]
    assert store.stats()["checksum_failures"] == 2
    assert store.stats()["records"] == 2


def test_truncated_while_closed_is_a_miss_after_reopen(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    store = open_store()
    records = write(store, chain(os.urandom(16), 2, 256 * KiB, 0))
    store.close()
    os.truncate(data_file(tmp_path), records[1].offset + 1000)

    reopened = open_store()
    loaded = reopened.load()  # the index still lists both; bytes are checked on read
    assert [read_ok(reopened, r) for r in loaded] == [True, False]


def test_stale_record_is_a_miss(open_store: StoreFactory) -> None:
    store = open_store()
    namespace = os.urandom(16)
    (old,) = write(store, chain(namespace, 1, 256 * KiB, 4 * MiB))
    # the slot is reused without removing the old record first
    (new,) = write(store, chain(namespace, 1, 256 * KiB, 4 * MiB))

    assert not read_ok(store, old)
    assert read_ok(store, new)
    assert store.lookup((namespace, old.key)) is None
    assert store.stats()["checksum_failures"] == 1


def test_stale_overlap_is_settled_on_load(open_store: StoreFactory) -> None:
    store = open_store()
    namespace = os.urandom(16)
    (old,) = write(store, chain(namespace, 1, 256 * KiB, 0))
    (new,) = write(store, chain(namespace, 1, 128 * KiB, 128 * KiB))  # overlaps old's tail
    store.close()

    reopened = open_store()
    assert [r.key for r in reopened.load()] == [new.key]
    assert reopened.stats()["dropped_overlapping"] == 1
    assert reopened.lookup((namespace, old.key)) is None


def test_orphans_dropped_on_load_until_prefix_closed(open_store: StoreFactory) -> None:
    store = open_store()
    kept_ns, cut_ns = os.urandom(16), os.urandom(16)
    kept = write(store, chain(kept_ns, 3, 64 * KiB, 0))
    cut = write(store, chain(cut_ns, 4, 64 * KiB, MiB))
    # a block whose parent lives only in another tier (or was never written)
    (stray,) = write(store, [BlockRecord(kept_ns, os.urandom(16), os.urandom(16), 2 * MiB, 4096)])
    # same key bytes as a kept block, other namespace: parents do not cross namespaces
    (crossed,) = write(store, [BlockRecord(cut_ns, os.urandom(16), kept[0].key, 3 * MiB, 4096)])
    run(store.remove([(cut_ns, cut[1].key)]))
    store.close()

    reopened = open_store()
    survivors = reopened.load()
    assert {r.key for r in survivors} == {kept[0].key, kept[1].key, kept[2].key, cut[0].key}
    seen: set[bytes] = set()
    for record in survivors:  # parents come before their children
        assert record.parent is None or record.namespace + record.parent in seen
        seen.add(record.namespace + record.key)
    assert reopened.stats()["dropped_orphans"] == 4  # cut[2], cut[3], stray, crossed
    assert reopened.stats()["records"] == 4
    for gone in (cut[2], cut[3], stray, crossed):
        assert reopened.lookup((gone.namespace, gone.key)) is None


def test_records_that_do_not_fit_the_layout_are_dropped(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    store = open_store()
    namespace = os.urandom(16)
    (good,) = write(store, chain(namespace, 1, 4096, 0))
    layout = store.layout
    store.close()

    index = SSDIndex(tmp_path / "ssd" / "index", layout, map_size=1 << 30, sync="always")
    try:
        index.commit(
            [
                BlockRecord(namespace, os.urandom(16), None, 64 * MiB - 4096, 8192),
                BlockRecord(namespace, os.urandom(16), None, 8 * MiB - 4096, 8192),
                BlockRecord(namespace[:8], os.urandom(16), None, 16 * MiB, 4096),
            ]
        )
    finally:
        index.close()

    reopened = open_store()
    assert [r.key for r in reopened.load()] == [good.key]
    assert reopened.stats()["dropped_invalid"] == 3
    assert reopened.stats()["records"] == 1


def test_scan_sets_apart_values_that_do_not_decode_or_match_their_key(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    store = open_store()
    layout = store.layout
    store.close()
    namespace = os.urandom(16)
    good = [BlockRecord(namespace, os.urandom(16), None, 4096 * i, 4096) for i in range(5000)]
    index = SSDIndex(tmp_path / "ssd" / "index", layout, map_size=1 << 30, sync="none")
    try:
        index.commit(good)
        with index._env.begin(write=True) as txn:  # among them (the scan reads in chunks)
            garbage, moved = namespace + b"\x00" * 16, namespace + b"\xff" * 16
            txn.put(garbage, b"\xc1 not msgpack", db=index._blocks)
            txn.put(moved, encode_record(good[0]), db=index._blocks)  # under another key
        records, bad = index.scan()
    finally:
        index.close()
    assert records == sorted(good, key=lambda r: r.index_key)
    assert bad == [garbage, moved]
