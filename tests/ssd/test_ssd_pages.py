"""The SSD index read in place (``ssd_pages``, ``SSDIndex.scan_mapped``) gives a warm
restart what the cursors give: every entry's key and value in key order, and the same
columns, bad keys and invalid keys; and where a page does not check out (or a value
needs an overflow page) nothing is read in place, the cursors decide."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.tiers import ssd_directory, ssd_pages
from kvstore.tiers.ssd import SSDStore
from kvstore.tiers.ssd_index import SSDIndex
from kvstore.tiers.ssd_layout import BlockRecord, SlabLayout, encode_record
from kvstore.tiers.ssd_pages import mapped_leaves
from kvstore.tiers.ssd_rows import Rows, RowsBuilder

MiB = 1 << 20
LAYOUT = SlabLayout(capacity_bytes=64 * MiB, slab_bytes=MiB)
SLOT = 4096


def _records(rng: random.Random, count: int) -> list[BlockRecord]:
    """Chains in three namespaces, at distinct slots, committed in no order."""
    spaces = [rng.randbytes(16) for _ in range(3)]
    slots = rng.sample(range(LAYOUT.capacity_bytes // SLOT), count)
    records, parent = [], None
    for i in range(count):
        if i % 40 == 0:
            parent = None
        key = rng.randbytes(16)
        records.append(BlockRecord(spaces[i % 3 if parent is None else 0], key, parent,
                                   slots[i] * SLOT, SLOT, checksum=rng.getrandbits(64),
                                   size_class=SLOT))
        parent = key if i % 3 == 0 else None
    rng.shuffle(records)
    return records


def _index(path: Path, records: list[BlockRecord], extra: dict[bytes, bytes]) -> SSDIndex:
    index = SSDIndex(path, LAYOUT, map_size=1 << 30, sync="none")
    index.commit(records)
    with index._env.begin(write=True) as txn:
        for key, value in extra.items():
            txn.put(key, value, db=index._blocks)
    return index


def _in_place(index: SSDIndex, chunk: int) -> list[tuple[bytes, bytes]] | None:
    with index._env.begin() as txn, mapped_leaves(
            index.path / "data.mdb", txn.id(), txn.stat(index._blocks)) as leaves:
        if leaves is None:
            return None
        entries = []
        for found in leaves.chunks(chunk):
            assert found is not None
            buf, key_at, lens = found
            for at, n in zip(key_at.tolist(), lens.tolist()):
                entries.append((buf[at:at + 32].tobytes(), buf[at + 32:at + 32 + n].tobytes()))
        return entries


def _by_cursor(index: SSDIndex) -> list[tuple[bytes, bytes]]:
    with index._env.begin() as txn:
        return list(txn.cursor(db=index._blocks))


def _columns(rows: Rows) -> dict[str, Any]:
    return {name: getattr(rows, name).tolist() for name in (
        "space", "key_words", "parent_words", "roots", "offset", "length", "checksum",
        "size_class")} | {"spaces": rows.spaces}


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 14])
def test_entries_read_in_place_are_the_cursors(tmp_path: Path, chunk: int) -> None:
    index = _index(tmp_path, _records(random.Random(chunk), 6000), {})
    try:
        with index._env.begin() as txn:
            assert txn.stat(index._blocks)["depth"] >= 2  # branch pages walked too
        assert _in_place(index, chunk) == _by_cursor(index)
    finally:
        index.close()


def test_a_scan_in_place_gives_the_cursors_columns_and_bad_keys(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = _records(rng, 5000)
    ns = records[0].namespace
    too_far = BlockRecord(ns, rng.randbytes(16), None, LAYOUT.capacity_bytes, SLOT,
                          size_class=SLOT)  # does not fit the layout: invalid
    extra = {ns + b"\x00" * 16: b"\xc1 not msgpack",             # does not decode: bad
             ns + b"\xff" * 16: encode_record(records[1]),      # under another key: bad
             too_far.index_key: encode_record(too_far)}
    index = _index(tmp_path, records, extra)
    try:
        mapped, by_cursor = RowsBuilder(LAYOUT, 10), RowsBuilder(LAYOUT, 10)
        bad = index.scan_mapped(mapped.add_mapped, None, 500)
        assert bad is not None
        assert bad == index.scan_into(by_cursor.add, None, 500)
        assert sorted(bad) == sorted(list(extra)[:2])
        assert mapped.invalid == by_cursor.invalid == [too_far.index_key]
        assert _columns(mapped.rows()) == _columns(by_cursor.rows())
    finally:
        index.close()


def test_a_value_past_a_page_is_left_to_the_cursors(tmp_path: Path) -> None:
    records = _records(random.Random(4), 300)
    index = _index(tmp_path, records, {records[0].namespace + b"\x01" * 16: os.urandom(9000)})
    try:
        assert _in_place(index, 100) is None  # an overflow page: not read in place
        assert index.scan_mapped(RowsBuilder(LAYOUT).add_mapped) is None
    finally:
        index.close()


def _leaf_pages(index: SSDIndex) -> list[int]:
    with index._env.begin() as txn, mapped_leaves(
            index.path / "data.mdb", txn.id(), txn.stat(index._blocks)) as leaves:
        assert leaves is not None
        return list(leaves.pages.tolist())


@pytest.mark.parametrize("damage", ["number", "kind", "slots", "node"])
def test_a_page_that_does_not_check_out_is_not_read_in_place(
        tmp_path: Path, damage: str) -> None:
    index = _index(tmp_path, _records(random.Random(5), 3000), {})
    page = _leaf_pages(index)[-1]
    index.close()
    data = tmp_path / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = page * 4096
    if damage == "number":
        raw[at] ^= 1                          # another page's number
    elif damage == "kind":
        raw[at + 10] = 0x01                   # a leaf that says it is a branch
    elif damage == "slots":
        raw[at + 12:at + 14] = (5000).to_bytes(2, "little")  # slots past the page
    else:
        slot = int.from_bytes(raw[at + 16:at + 18], "little")
        raw[at + slot + 6] = 31               # a node's key of 31 bytes
    data.write_bytes(bytes(raw))
    index = SSDIndex(tmp_path, LAYOUT, map_size=1 << 30, sync="none")
    try:
        assert index.scan_mapped(RowsBuilder(LAYOUT).add_mapped, None, 500) is None
    finally:
        index.close()


def _plan(path: Path) -> dict[str, Any]:
    engine = SSDStore(path, LAYOUT.capacity_bytes, slab_bytes=LAYOUT.slab_bytes, sync="none",
                      direct_io=False, preallocate=False)
    try:
        plan = engine.load_rows()
        return {"order": plan.order.tolist(), "parent": plan.parent.tolist(),
                "keys": plan.keys, "dropped": plan.dropped_keys, **_columns(plan.rows)}
    finally:
        engine.close()


def test_a_restore_whose_pages_fail_halfway_is_the_cursors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(6)
    records = _records(rng, 3000)
    records.append(BlockRecord(records[0].namespace, rng.randbytes(16), rng.randbytes(16),
                               0, SLOT, size_class=SLOT))  # an orphan: dropped
    engine = SSDStore(tmp_path, LAYOUT.capacity_bytes, slab_bytes=LAYOUT.slab_bytes,
                      sync="none", direct_io=False, preallocate=False)
    engine._parts()[1].commit(records)
    engine.close()
    shutil.copytree(tmp_path, tmp_path.parent / "again")
    monkeypatch.setattr(ssd_directory, "_ROWS_CHUNK", 500)
    whole = _plan(tmp_path)
    assert len(whole["keys"]) == 3000 and len(whole["dropped"]) == 1
    real, calls = ssd_pages._entries, []

    def failing_second(buf: np.ndarray, size: int, counts: np.ndarray) -> Any:
        calls.append(len(counts))
        return None if len(calls) == 2 else real(buf, size, counts)

    monkeypatch.setattr(ssd_pages, "_entries", failing_second)
    assert _plan(tmp_path.parent / "again") == whole
    assert len(calls) == 2  # then by cursors
